"""Model-agnostic parallelism: role topology, per-role process groups, bridges, meshes, FSDP2."""
