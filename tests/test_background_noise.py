"""`checkpoint/background_noise`: after a failure the CLI reports in words, the errors of Orbax's and
tensorstore's background work are not printed again; any other error still is."""

import asyncio
import gc
import logging

from zaya_jax.checkpoint.background_noise import quiet_background_failures

TENSORSTORE = ('OUT_OF_RANGE: Error opening "zarr3" driver: Error reading Byte range [0, 13614) of local file '
               '"/ckpt/state/d/cbb1": Requested byte range [0, 13614) is not valid for value of size 10 '
               '[tensorstore_spec=\'{"driver":"zarr3"}\']')


def _abandon_a_failed_future(error: Exception) -> None:
    """What tensorstore's reads leave behind on a damaged checkpoint: a failed future no one awaits,
    which asyncio logs ("Future exception was never retrieved") when it is collected."""
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(error)
    del future
    gc.collect()
    loop.close()


def test_a_tensorstore_error_no_one_retrieved_is_not_logged_again_but_another_is(caplog):
    quiet_background_failures()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _abandon_a_failed_future(ValueError(TENSORSTORE))
        assert not [r for r in caplog.records if r.name == "asyncio"]
        _abandon_a_failed_future(ValueError("a bug of ours"))
    logged = [r for r in caplog.records if r.name == "asyncio"]
    assert len(logged) == 1 and "never retrieved" in logged[0].getMessage()
    assert str(logged[0].exc_info[1]) == "a bug of ours"
