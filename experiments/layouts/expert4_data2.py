"""Expert parallel x data: 4 devices each own one of the 4 experts; tokens reach their expert by an
all-gather over `expert` and return by a reduce-scatter; 2 data-parallel replicas.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 zaya train --config=experiments/layouts/expert4_data2.py \\
        --workdir=/tmp/zaya_expert4_data2
"""

import os

from zaya_jax.experiment import config_from_file


def get_config():
    config = config_from_file(os.path.join(os.path.dirname(__file__), "base.py"))
    config.mesh.expert = 4
    return config
