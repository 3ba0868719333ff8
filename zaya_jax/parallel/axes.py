"""The mesh axis names, in mesh order, and the roles they play (no imports: anything may use it)."""

MESH_AXES = ("data", "fsdp", "expert", "tsp", "tensor", "sequence")
BATCH_AXES = ("data", "fsdp", "expert")  # every device on these axes reads different sequences
SEQUENCE_AXES = ("tsp", "sequence")  # these split each sequence into contiguous chunks, in this order
MODEL_AXES = ("expert", "tsp", "tensor")  # these split weights that the layers' schedules use sharded
# Where each axis sits on the machine, outermost first: consecutive devices (one node's GPUs) vary
# the last axis fastest, so the chattiest axes (tensor and tsp move activations or weights every
# layer, expert moves tokens every layer, fsdp moves weights every micro-batch) stay inside a node
# and data (one gradient reduction per micro-batch) spans the nodes. CCA's K/V are small (one
# 256-wide latent per KV head), so sequence gives up the node to fsdp.
PLACEMENT = ("data", "sequence", "fsdp", "expert", "tsp", "tensor")
