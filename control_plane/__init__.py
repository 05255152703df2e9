"""The control plane: reads worker snapshots, computes VLT/LVF plans, publishes them."""
