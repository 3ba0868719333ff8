"""The mesh axis names, in mesh order, and the roles they play (no imports: anything may use it)."""

MESH_AXES = ("data", "fsdp", "expert", "tsp", "tensor", "sequence")
BATCH_AXES = ("data", "fsdp", "expert")  # every device on these axes reads different sequences
SEQUENCE_AXES = ("tsp", "sequence")  # these split each sequence into contiguous chunks, in this order
MODEL_AXES = ("expert", "tsp", "tensor")  # these split weights that the layers' schedules use sharded
