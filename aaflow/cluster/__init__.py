"""The cluster layer: Ray actors hosting model replicas, the deployment, the KV directory and
references, transports, and calibration and planning on a live cluster. Layer: cluster."""
