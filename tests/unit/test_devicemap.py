"""The device map's one text form: parse, encode, and the environment entry CRIU's plugin reads."""

from __future__ import annotations

import pytest

from snapguard.devicemap import DeviceMap


def test_parse_and_encode_round_trip() -> None:
    m = DeviceMap.parse("GPU-a=GPU-b, 0=1")
    assert m.pairs == (("GPU-a", "GPU-b"), ("0", "1")) and list(m) == list(m.pairs) and len(m) == 2 and m
    assert m.encode() == "GPU-a=GPU-b,0=1" and DeviceMap.parse(m.encode()) == m
    assert not DeviceMap(())


@pytest.mark.parametrize("text", ["GPU-a", "a=", "=b", "x=y z", "a=b,", "a;b=c"])
def test_an_entry_that_is_not_old_new_is_refused_in_one_line(text: str) -> None:
    with pytest.raises(ValueError) as e:
        DeviceMap.parse(text)
    assert "OLD_UUID=NEW_UUID" in str(e.value) and "\n" not in str(e.value)


def test_environment() -> None:
    env: dict[str, str] = {}
    DeviceMap(()).into_env(env)
    assert env == {}
    DeviceMap.parse("GPU-a=GPU-b").into_env(env)
    assert env == {DeviceMap.ENV: "GPU-a=GPU-b"} and DeviceMap.ENV == "SNAPGUARD_DEVICE_MAP"
    assert DeviceMap.from_env(env) == DeviceMap((("GPU-a", "GPU-b"),))
    assert DeviceMap.from_env({}) is None
    with pytest.raises(ValueError):
        DeviceMap.from_env({DeviceMap.ENV: "broken"})
