"""The mesh-layout explorer (`zaya mesh`): predict per-device memory and step time of every layout.

`inventory` counts the model's state per device, `placement` enumerates layouts and says which
links each axis crosses, `collectives` prices a collective on those links, `memory` and
`step_time` make the predictions, `explorer` ranks them, `report` prints and writes them, and
`validate` compiles the real train step to check the predictions against XLA.
"""
