"""The mesh axis names, in mesh order, and which of them split the batch (no imports: anything may use it)."""

MESH_AXES = ("data", "fsdp", "expert", "tsp", "tensor", "sequence")
BATCH_AXES = ("data", "fsdp", "expert")  # every device on these axes reads different sequences
