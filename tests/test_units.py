"""Byte sizes and durations from flags: every bad one is a ValueError (a usage error) that
names it."""

from __future__ import annotations

import pytest

from agentkv.flags import parse_config
from agentkv.gateway.config import GatewayConfig
from agentkv.units import human_seconds, parse_bytes, parse_seconds
from cache_store.__main__ import build_config as store_config
from inference_worker.__main__ import build_config as worker_config

MAX_BYTES = (1 << 63) - 1  # the int64 fields that carry sizes
BAD_SIZES = ["-1", "-0.5G", "infG", "nanG", "1e400G", "9" * 400, "lots", "", "9E"]


def test_sizes_parse_up_to_the_largest():
    assert [parse_bytes(s) for s in ("0", "512M", "1.5GiB", str(MAX_BYTES))] == [
        0,
        512 << 20,
        3 << 29,
        MAX_BYTES,
    ]


def test_durations_parse_in_their_units_and_print_in_the_largest_whole_one():
    texts = ("0", "90", "90s", "30m", "1.5h", "7d", " 12H ")
    seconds = [parse_seconds(t) for t in texts]
    assert seconds == [0, 90, 90, 1800, 5400, 604800, 43200]
    assert [human_seconds(s) for s in seconds] == ["0s", "90s", "90s", "30m", "90m", "7d", "12h"]
    assert human_seconds(1.5) == "1.5s"


@pytest.mark.parametrize("text", ["-1", "-1d", "nan", "inf", "infd", "1e400", "", "d", "1y", "1dd"])
def test_a_bad_duration_is_a_value_error_naming_it(text):
    with pytest.raises(ValueError, match=f"not a duration: {text!r}"):
        parse_seconds(text)


@pytest.mark.parametrize("text", BAD_SIZES)
def test_a_bad_size_is_a_value_error_naming_it(text):
    with pytest.raises(ValueError, match=f"not a byte size: {text!r}"):
        parse_bytes(text)
    with pytest.raises(ValueError):
        parse_bytes(str(MAX_BYTES + 1))


@pytest.mark.parametrize(
    ("build", "argv"),
    [
        (store_config, ["--data-dir", "unused", "--quota={}"]),
        (store_config, ["--data-dir", "unused", "--namespace-quota", "a={}"]),
        (worker_config, ["--model", "m", "--store", "127.0.0.1:1", "--hot-budget={}"]),
        (
            lambda argv: parse_config(GatewayConfig, "gw", None, argv),
            ["--worker", "h:1", "--max-body={}"],
        ),
    ],
    ids=["quota", "namespace-quota", "hot-budget", "max-body"],
)
@pytest.mark.parametrize("text", ["infG", "1e400G", "-1"])
def test_a_bad_size_flag_is_a_usage_error(capsys, build, argv, text):
    with pytest.raises(SystemExit) as exit:
        build([arg.format(text) for arg in argv])
    assert exit.value.code == 2
    assert text in capsys.readouterr().err.splitlines()[-1]


def test_a_hot_budget_of_nothing_is_a_usage_error(capsys):
    """No turn could ever run in a hot budget of 0: refused at start, not turn by turn."""
    with pytest.raises(SystemExit) as exit:
        worker_config(["--model", "m", "--store", "127.0.0.1:1", "--hot-budget", "0"])
    assert exit.value.code == 2
    # the flag, as the user gave it (the red team's: the field's name, hot_budget_bytes)
    assert "error: --hot-budget must be > 0, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--timeout", "0"], "--timeout must be above 0 seconds, got 0.0"),
        (["--timeout", "-1"], "--timeout must be above 0 seconds, got -1.0"),
        (["--max-body", "0"], "--max-body must be at least 1K, got 0"),
        (["--cleanup-seconds", "-1"], "--cleanup-seconds must be 0 or more, got -1.0"),
    ],
)
def test_a_gateway_flag_no_call_could_pass_is_a_usage_error(capsys, flags, message):
    """A gateway whose every call would end at once (504, or a 503 blaming the workers) or
    be too big (413) is refused at start; it served, and failed every call."""
    with pytest.raises(SystemExit) as exit:
        parse_config(GatewayConfig, "gw", None, ["--worker", "h:1", *flags])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_a_store_of_one_rpc_thread_is_refused_naming_workers(capsys):
    """Streams take at most all threads but one, so one thread leaves them none; the
    message spoke of max_streams in "1..0"."""
    with pytest.raises(SystemExit):
        store_config(["--data-dir", "unused", "--workers", "1"])
    assert "workers must be >= 2, got 1" in capsys.readouterr().err
