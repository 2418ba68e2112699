"""The planner's pure part: per-edge strategy search (`search`) over the scheduler run on the
simulated clock (`simulate`), and the plans it returns (`plans`). No Ray, no live cluster; its glue
to a live cluster (`af.plan`) is `aaflow.cluster.planning`. Layer: core."""
