"""Another library's error quoted inside a one-line ZayaError: one line, bounded, never empty."""

from zaya_jax.errors import quoted


def test_a_quoted_error_is_one_bounded_line():
    error = OSError("first   line\n  second\tline")
    assert quoted(error) == "first line second line"
    assert quoted(error, first_line=True) == "first line"
    long = quoted(ValueError("x" * 500), limit=50)
    assert len(long) == 50 and long.endswith("...")


def test_an_error_without_a_message_is_named_by_its_type():
    assert quoted(KeyError()) == "KeyError"
    assert quoted(RuntimeError("   "), first_line=True) == "RuntimeError"


def test_quoted_drops_reprs_of_internal_objects_and_keeps_the_words():
    """Orbax errors embedded `<bound method pybind11_detail_function_record_... at 0x...>`."""
    error = ValueError("cannot restore <bound method pybind11_detail_function_record_v1.read of "
                       "<tensorstore.KvStore object at 0x7f3a2c1b9e70>>: DATA_LOSS reading 'state/d/ab12'")
    assert quoted(error) == "cannot restore : DATA_LOSS reading 'state/d/ab12'"
    assert quoted(ValueError("shapes <4, 5> and <5, 4> differ")) == "shapes <4, 5> and <5, 4> differ"
