"""The Capacity API's settings: capacity_listen and its TLS files,
capacity_insecure (the first bool setting: TOML true/false, a bare flag),
capacity_advertise and reservation_ttl, refused at start when wrong."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cgpud import config
from cgpud.errors import UsageError


def _load(tmp_path: Path, text: str = "", **flags: object) -> config.DaemonConfig:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return config.load(path, flags)


def _flags(*argv: str) -> config.DaemonConfig:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return config.from_arguments(parser.parse_args(["--config", "/dev/null", *argv]))


def test_defaults_serve_nothing():
    c = config.DaemonConfig()
    assert (c.capacity_listen, c.capacity_insecure, c.capacity_advertise, c.reservation_ttl) == ("", False, "", 120.0)
    assert config.validate(c) == c


def test_loopback_plaintext_needs_nothing_else(tmp_path: Path):
    assert _flags("--capacity-listen", "127.0.0.1:9455").capacity_listen == "127.0.0.1:9455"
    assert _load(tmp_path, 'capacity_listen = "[::1]:0"\n').capacity_listen == "[::1]:0"


def test_plaintext_off_loopback_is_refused_naming_what_to_set(tmp_path: Path):
    with pytest.raises(
        UsageError,
        match=r"capacity_listen = '0.0.0.0:9455' is not a loopback address.*"
        r"capacity_tls_cert.*capacity_insecure = true",
    ):
        _flags("--capacity-listen", "0.0.0.0:9455")
    assert _load(tmp_path, 'capacity_listen = "0.0.0.0:9455"\ncapacity_insecure = true\n').capacity_insecure
    assert _flags("--capacity-listen", "0.0.0.0:9455", "--capacity-insecure").capacity_insecure
    with pytest.raises(UsageError, match="not a loopback"):
        _flags("--capacity-listen", "[::]:9455", "--capacity-insecure", "false")
    tls = ("--capacity-tls-cert", "c.pem", "--capacity-tls-key", "k.pem", "--capacity-tls-ca", "ca.pem")
    assert _flags("--capacity-listen", "0.0.0.0:9455", *tls).capacity_tls_ca == "ca.pem"


def test_tls_files_come_all_three(tmp_path: Path):
    with pytest.raises(UsageError, match="capacity_tls_key, capacity_tls_ca are not set"):
        _load(tmp_path, 'capacity_tls_cert = "c.pem"\n')
    with pytest.raises(UsageError, match="capacity_tls_cert is not set"):
        _flags("--capacity-tls-key", "k.pem", "--capacity-tls-ca", "ca.pem")


@pytest.mark.parametrize(
    "text, message",
    [
        ('capacity_listen = "9455"', "setting capacity_listen = '9455' is not HOST:PORT"),
        ('capacity_listen = "::1:9455"', "put an IPv6 address in brackets"),
        ('capacity_listen = "127.0.0.1:70000"', "the port must be a number 0-65535"),
        ('capacity_advertise = "a b"', "setting capacity_advertise"),
        ("capacity_insecure = 1", "setting capacity_insecure = 1 is not valid"),
        ('capacity_insecure = "maybe"', "setting capacity_insecure = 'maybe' is not valid"),
        ("reservation_ttl = 0.5", "reservation_ttl must be between 1 and 3600 seconds"),
        ("reservation_ttl = 3601", "reservation_ttl must be between 1 and 3600 seconds"),
    ],
)
def test_wrong_values_are_refused_with_the_setting_named(tmp_path: Path, text: str, message: str):
    with pytest.raises(UsageError, match=message):
        _load(tmp_path, text + "\n")


def test_advertise_and_ttl_are_read(tmp_path: Path):
    c = _load(tmp_path, 'capacity_advertise = "[fd00::1]:9455"\nreservation_ttl = 30\n')
    assert (c.capacity_advertise, c.reservation_ttl) == ("[fd00::1]:9455", 30.0)
    assert _flags("--capacity-advertise", "node-1.example").capacity_advertise == "node-1.example"
