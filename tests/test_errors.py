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
