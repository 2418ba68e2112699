"""What every layer shares: typed errors, strategy names, progress output and machine facts.
These modules import nothing else of aaflow. Layer: core."""
