"""The layer check of tests/conftest.py: collection fails, naming each test, unless every test has exactly
one of the markers unit, property (a Hypothesis test) or launch; `make test-fast` runs unit and property."""

import textwrap

import pytest

from helpers import LayerCheck

pytestmark = pytest.mark.unit

SAMPLE = """
    import pytest
    from hypothesis import given, strategies as st

    pytestmark = pytest.mark.unit


    def test_chose_its_layer():
        pass


    @pytest.mark.launch
    def test_both_layers():
        pass
"""
UNMARKED = """
    import pytest
    from hypothesis import given, strategies as st


    def test_without_a_layer():
        pass


    @pytest.mark.property
    def test_a_property_without_hypothesis():
        pass


    @pytest.mark.property
    @given(st.integers())
    def test_a_real_property(number):
        pass
"""


def collect(folder, capsys, *options):
    """Collect `folder` in this process with the layer check; (exit status, what pytest printed)."""
    status = pytest.main(
        [
            str(folder),
            "--collect-only",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(folder),
            "-W",
            "ignore::pytest.PytestUnknownMarkWarning",
            *options,
        ],
        plugins=[LayerCheck()],
    )
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def test_collection_fails_naming_each_test_without_exactly_one_layer(tmp_path, capsys):
    (tmp_path / "test_layers_sample.py").write_text(textwrap.dedent(SAMPLE))
    (tmp_path / "test_layers_unmarked.py").write_text(textwrap.dedent(UNMARKED))
    for options in ((), ("-m", "unit or property")):  # deselection hides no test from the check
        status, output = collect(tmp_path, capsys, *options)
        assert status == pytest.ExitCode.USAGE_ERROR, output
        output = output.split("each test needs exactly one layer marker", 1)[1]  # the error, not the listing
        assert "test_layers_sample.py::test_both_layers: unit and launch" in output
        assert "test_layers_unmarked.py::test_without_a_layer: no layer" in output
        assert "test_a_property_without_hypothesis: property, but not a Hypothesis test" in output
        assert "test_chose_its_layer" not in output and "test_a_real_property" not in output


def test_tests_with_one_layer_each_are_collected(tmp_path, capsys):
    (tmp_path / "test_layers_good.py").write_text(textwrap.dedent(SAMPLE).replace("@pytest.mark.launch\n", ""))
    status, output = collect(tmp_path, capsys)
    assert status == pytest.ExitCode.OK, output
    assert "2 tests collected" in output
