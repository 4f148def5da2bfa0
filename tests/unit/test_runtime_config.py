"""`cgpuctl runtime configure`: the files it writes for containerd and Docker,
read back by tomllib/json and, for containerd, by containerd's own config
loader (`containerd config dump` loads a config with its imports and prints
the merged result without starting the daemon)."""

from __future__ import annotations

import copy
import json
import shutil
import stat
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpud.cli import containerd_config as cc
from cgpud.cli import runtime_configure as rc
from cgpud.cli.main import main
from cgpud.cli.runtime_configure import Engine, RuntimeSpec
from cgpud.errors import CgpuError, UsageError

CONTAINERD = shutil.which("containerd") or "/usr/bin/containerd"
CRI = "io.containerd.grpc.v1.cri"


@pytest.fixture
def shim(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "cgpu-runtime"
    path.parent.mkdir()
    for program in (path, path.with_name("cgpu-runtime-gpu")):
        program.write_text("#!/bin/sh\nexit 0\n")
        program.chmod(0o755)
    return path


def spec(shim: Path, **kw: Any) -> RuntimeSpec:
    return RuntimeSpec(name=kw.pop("name", "cgpu"), path=shim, **kw)


def configure(engine: Engine, config: Path, shim: Path, major: int | None = 1, **kw: Any) -> str:
    dry_run = kw.pop("dry_run", False)
    return rc.configure(engine, spec(shim, **kw), config=config, dry_run=dry_run, containerd_major=major)


def snapshot(root: Path) -> dict[str, tuple[bytes, int, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_mode)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def need_containerd() -> None:
    if not Path(CONTAINERD).is_file():
        pytest.skip(f"{CONTAINERD} is not installed (Debian package containerd)")


def containerd_dump(config: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [CONTAINERD, "--config", str(config), "config", "dump"], check=False, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return tomllib.loads(proc.stdout)


def default_config(tmp_path: Path) -> str:
    """containerd's own default config, pointed at private directories, with
    settings an operator typically changes."""
    need_containerd()
    text = subprocess.run(
        [CONTAINERD, "config", "default"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    lines = []
    for line in text.splitlines(keepends=True):
        key = line.strip().split(" = ")[0]
        if key == "root":
            line = f'root = "{tmp_path}/root"\n'
        elif key == "state":
            line = f'state = "{tmp_path}/state"\n'
        elif key == "sandbox_image":
            line = line.split("=")[0] + '= "registry.example.com/pause:9"\n'
        elif key == "max_concurrent_downloads":
            line = line.split("=")[0] + "= 7\n"
        elif key == "SystemdCgroup":
            line = line.split("=")[0] + "= true\n"
        lines.append(line)
    out = "# operator's config: keep this comment\n" + "".join(lines)
    assert "registry.example.com/pause:9" in out and "SystemdCgroup = true" in out
    return out


# ---------------------------------------------------------------- containerd, real parser


def test_containerd_loads_the_runtime_and_keeps_every_setting(tmp_path, shim):
    config = tmp_path / "containerd" / "config.toml"
    config.parent.mkdir()
    original = default_config(tmp_path)
    config.write_text(original)
    before = containerd_dump(config)

    out = configure(Engine.CONTAINERD, config, shim, major=cc.containerd_major_version(CONTAINERD))
    assert f"created {config.parent}/conf.d/cgpu.toml" in out
    assert 'restart containerd (systemctl restart containerd) to load the runtime "cgpu"' in out

    # config.toml: exactly the imports entry was added, every other byte kept.
    glob = f"{config.parent}/conf.d/*.toml"
    assert config.read_text() == original.replace("imports = []", f'imports = ["{glob}"]', 1)
    assert (tmp_path / "containerd" / "config.toml.cgpu.bak").read_text() == original

    after = containerd_dump(config)
    runtimes = after["plugins"][CRI]["containerd"]["runtimes"]
    assert runtimes["cgpu"]["runtime_type"] == "io.containerd.runc.v2"
    assert runtimes["cgpu"]["options"]["BinaryName"] == str(shim)
    # The new runtime runs containers the way runc does here (same cgroup driver).
    assert runtimes["cgpu"]["options"]["SystemdCgroup"] is True

    # containerd's merged view differs from before only by the new runtime and
    # the imports list: no setting of config.toml was lost to the merge.
    expected = copy.deepcopy(before)
    expected["imports"] = after["imports"]
    expected["plugins"][CRI]["containerd"]["runtimes"]["cgpu"] = runtimes["cgpu"]
    assert after == expected
    assert after["plugins"][CRI]["sandbox_image"] == "registry.example.com/pause:9"
    assert after["plugins"][CRI]["max_concurrent_downloads"] == 7
    assert after["plugins"][CRI]["containerd"]["default_runtime_name"] == "runc"


def commented(config_text: str) -> str:
    """`containerd config default` with an operator's comments: a line above
    every table header and a trailing comment on every key line."""
    out = []
    for n, line in enumerate(config_text.splitlines(keepends=True)):
        body = line.rstrip("\n")
        if body.lstrip().startswith("["):
            out.append(f"# note {n}: the table below\n{line}")
        elif " = " in body and not body.rstrip().endswith(("[", "{")) and '"""' not in body:
            out.append(f"{body}  # note {n}\n")
        else:
            out.append(line)
    return "".join(out)


def test_cli_keeps_every_comment_and_key_order_of_a_real_config(tmp_path, shim, capsys):
    config = tmp_path / "containerd" / "config.toml"
    config.parent.mkdir()
    original = commented(default_config(tmp_path))
    assert original.count("# note") > 50
    config.write_text(original)
    before = containerd_dump(config)

    assert main(["runtime", "configure", "--containerd", "--config", str(config), "--runtime-path", str(shim)]) == 0
    assert "created" in capsys.readouterr().out

    # Every line of config.toml, comments included, is kept in its order: the
    # only change is the imports entry.
    glob = f"{config.parent}/conf.d/*.toml"
    assert config.read_text() == original.replace("imports = []", f'imports = ["{glob}"]', 1)
    # The drop-in's copy of the CRI section keeps the operator's comments too.
    dropin = (config.parent / "conf.d" / "cgpu.toml").read_text()
    cri_notes = [
        line.strip()
        for line in original.splitlines()
        if "# note" in line and ("sandbox_image" in line or "max_concurrent_downloads" in line)
    ]
    assert cri_notes and all(note in dropin for note in cri_notes)

    after = containerd_dump(config)
    assert after["plugins"][CRI]["containerd"]["runtimes"]["cgpu"]["options"]["BinaryName"] == str(shim)
    expected = copy.deepcopy(before)
    expected["imports"] = after["imports"]
    expected["plugins"][CRI]["containerd"]["runtimes"]["cgpu"] = after["plugins"][CRI]["containerd"]["runtimes"]["cgpu"]
    assert after == expected


def test_containerd_set_as_default_through_the_real_parser(tmp_path, shim):
    config = tmp_path / "config.toml"
    config.write_text(default_config(tmp_path))
    configure(Engine.CONTAINERD, config, shim, set_as_default=True)
    after = containerd_dump(config)
    assert after["plugins"][CRI]["containerd"]["default_runtime_name"] == "cgpu"
    assert after["plugins"][CRI]["containerd"]["runtimes"]["cgpu"]["options"]["BinaryName"] == str(shim)
    assert after["plugins"][CRI]["sandbox_image"] == "registry.example.com/pause:9"


def test_containerd_minimal_config_keeps_the_builtin_runc(tmp_path, shim):
    """An imported CRI section replaces containerd 1.x's built-in one: runc,
    which default_runtime_name names, must still be there."""
    need_containerd()
    config = tmp_path / "config.toml"
    config.write_text(f'version = 2\nroot = "{tmp_path}/root"\nstate = "{tmp_path}/state"\n')
    before = containerd_dump(config)
    configure(Engine.CONTAINERD, config, shim)
    after = containerd_dump(config)
    runtimes = after["plugins"][CRI]["containerd"]["runtimes"]
    builtin = before["plugins"][CRI]["containerd"]["runtimes"]["runc"]
    assert {k: v for k, v in runtimes["runc"].items() if k != "options"} == {
        k: v for k, v in builtin.items() if k != "options"
    }
    # containerd prints the built-in runc options as zero values, which is what
    # no options means to the runc shim.
    assert not any(builtin["options"].values()) and not any(runtimes["runc"].get("options", {}).values())
    assert runtimes["cgpu"]["options"] == {"BinaryName": str(shim)}
    assert after["plugins"][CRI]["containerd"]["default_runtime_name"] == "runc"


def test_containerd_version1_config_through_the_real_parser(tmp_path, shim):
    need_containerd()
    config = tmp_path / "config.toml"
    config.write_text(
        f'root = "{tmp_path}/root"\nstate = "{tmp_path}/state"\n\n'
        '[plugins.cri]\n  sandbox_image = "registry.example.com/pause:9"\n'
    )
    configure(Engine.CONTAINERD, config, shim, set_as_default=True)
    dropin = tomllib.loads((tmp_path / "conf.d" / "cgpu.toml").read_text())
    assert dropin["version"] == 1
    assert dropin["plugins"]["cri"]["containerd"]["runtimes"]["cgpu"]["options"]["BinaryName"] == str(shim)
    after = containerd_dump(config)
    assert after["plugins"][CRI]["containerd"]["runtimes"]["cgpu"]["options"]["BinaryName"] == str(shim)
    assert after["plugins"][CRI]["containerd"]["default_runtime_name"] == "cgpu"
    assert after["plugins"][CRI]["sandbox_image"] == "registry.example.com/pause:9"


def test_installed_containerd_version_is_read():
    need_containerd()
    assert isinstance(cc.containerd_major_version(CONTAINERD), int)
    assert cc.containerd_major_version("no-such-containerd-binary") is None


# ---------------------------------------------------------------- containerd, files


def test_containerd_twice_changes_nothing(tmp_path, shim):
    config = tmp_path / "config.toml"
    config.write_text('version = 2\n\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "p:1"\n')
    configure(Engine.CONTAINERD, config, shim, set_as_default=True)
    files = snapshot(tmp_path)
    assert configure(Engine.CONTAINERD, config, shim, set_as_default=True).startswith("already configured")
    assert configure(Engine.CONTAINERD, config, shim, set_as_default=True, dry_run=True) == "no changes\n"
    assert snapshot(tmp_path) == files


def test_containerd_backup_is_the_first_original(tmp_path, shim):
    config = tmp_path / "config.toml"
    config.write_text("version = 2\n")
    configure(Engine.CONTAINERD, config, shim)
    config.write_text("version = 2\noom_score = -999\n")  # the operator rewrites it
    assert "original kept" not in configure(Engine.CONTAINERD, config, shim)
    assert config.read_text() == f'version = 2\noom_score = -999\nimports = ["{tmp_path}/conf.d/*.toml"]\n'
    assert (tmp_path / "config.toml.cgpu.bak").read_text() == "version = 2\n"
    assert not list((tmp_path / "conf.d").glob("*.bak"))


def test_containerd_missing_config_gets_a_minimal_one(tmp_path, shim):
    config = tmp_path / "etc" / "containerd" / "config.toml"
    out = configure(Engine.CONTAINERD, config, shim)
    assert f"created {config}" in out
    assert config.read_text() == f'version = 2\nimports = ["{config.parent}/conf.d/*.toml"]\n'
    assert stat.S_IMODE((config.parent / "conf.d").stat().st_mode) == 0o755
    assert not (config.parent / "config.toml.cgpu.bak").exists()
    dropin = tomllib.loads((config.parent / "conf.d" / "cgpu.toml").read_text())
    assert dropin["version"] == 2
    assert dropin["plugins"][CRI]["containerd"]["runtimes"] == {
        "runc": {"runtime_type": "io.containerd.runc.v2"},
        "cgpu": {"runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": str(shim)}},
    }
    # containerd 2.x's default config is version 3.
    changes = cc.containerd_changes(config, None, None, spec(shim), containerd_major=2)
    assert changes[1].new.startswith("version = 3\n")


def test_containerd_keeps_file_mode_and_dropin_is_no_more_readable(tmp_path, shim):
    config = tmp_path / "config.toml"
    config.write_text("version = 2\n")
    config.chmod(0o600)
    configure(Engine.CONTAINERD, config, shim)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "conf.d" / "cgpu.toml").stat().st_mode) == 0o600
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_containerd_version3_and_version1_plugin_names(tmp_path, shim):
    config = tmp_path / "config.toml"
    v3 = cc.containerd_changes(config, "version = 3\n", None, spec(shim, set_as_default=True), containerd_major=2)
    doc = tomllib.loads(v3[0].new)
    # containerd 2.x merges plugin sections key by key: the drop-in holds only ours.
    assert doc == {
        "version": 3,
        "plugins": {
            "io.containerd.cri.v1.runtime": {
                "containerd": {
                    "default_runtime_name": "cgpu",
                    "runtimes": {
                        "cgpu": {"runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": str(shim)}}
                    },
                }
            }
        },
    }
    assert '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.cgpu.options]' in v3[0].new

    v1 = cc.containerd_changes(config, "oom_score = 0\n", None, spec(shim), containerd_major=1)
    doc = tomllib.loads(v1[0].new)
    assert doc["version"] == 1
    assert doc["plugins"]["cri"]["containerd"]["runtimes"]["cgpu"]["options"]["BinaryName"] == str(shim)
    assert "[plugins.cri.containerd.runtimes.cgpu]" in v1[0].new

    v2 = cc.containerd_changes(config, "version = 2\n", None, spec(shim), containerd_major=2)
    assert tomllib.loads(v2[0].new)["plugins"][CRI] == {
        "containerd": {
            "runtimes": {"cgpu": {"runtime_type": "io.containerd.runc.v2", "options": {"BinaryName": str(shim)}}}
        }
    }

    with pytest.raises(UsageError, match="version 3, which the installed containerd 1.x cannot read"):
        cc.containerd_changes(config, "version = 3\n", None, spec(shim), containerd_major=1)
    with pytest.raises(UsageError, match=r"version = 7 is not a containerd config version"):
        cc.containerd_changes(config, "version = 7\n", None, spec(shim), containerd_major=1)


def test_containerd_bad_toml_changes_nothing(tmp_path, shim):
    config = tmp_path / "config.toml"
    config.write_text("version = 2\n[plugins\n")
    files = snapshot(tmp_path)
    with pytest.raises(UsageError, match=rf"{config} is not valid TOML: .*line 2"):
        configure(Engine.CONTAINERD, config, shim)
    assert snapshot(tmp_path) == files and not (tmp_path / "conf.d").exists()


def test_containerd_dry_run_writes_nothing_and_prints_the_diff(tmp_path, shim):
    config = tmp_path / "config.toml"
    config.write_text("# mine\nversion = 2\n")
    files = snapshot(tmp_path)
    out = configure(Engine.CONTAINERD, config, shim, dry_run=True)
    assert snapshot(tmp_path) == files and not (tmp_path / "conf.d").exists()
    assert f"--- {config}\n+++ {config} (cgpu)\n" in out
    assert f'+imports = ["{tmp_path}/conf.d/*.toml"]\n' in out
    assert f"--- {tmp_path}/conf.d/cgpu.toml\n+++ {tmp_path}/conf.d/cgpu.toml (cgpu)\n" in out
    assert f'+BinaryName = "{shim}"\n' in out


def test_containerd_existing_import_is_respected(tmp_path, shim):
    config = tmp_path / "config.toml"
    text = 'version = 2\nimports = ["conf.d/*.toml"]  # relative to this file\n'
    changes = cc.containerd_changes(config, text, None, spec(shim), containerd_major=1)
    assert changes[1].new == text
    exact = f'version = 2\nimports = ["{tmp_path}/conf.d/cgpu.toml"]\n'
    assert cc.containerd_changes(config, exact, None, spec(shim), containerd_major=1)[1].new == exact


def test_containerd_with_cri_disabled_is_configured_with_a_warning(tmp_path, shim):
    """Docker's containerd.io package ships this config."""
    config = tmp_path / "config.toml"
    config.write_text('disabled_plugins = ["cri"]\n')
    out = configure(Engine.CONTAINERD, config, shim)
    assert out.endswith(
        f"warning: {config} disables the CRI plugin (disabled_plugins): Kubernetes cannot use "
        "containerd or this runtime until it is enabled; for Docker, use --docker\n"
    )
    assert "warning:" not in configure(Engine.CONTAINERD, tmp_path / "other.toml", shim)


# ---------------------------------------------------------------- imports editing


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("version = 2\nimports = []\n", 'version = 2\nimports = ["/x/*.toml"]\n'),
        ('imports = ["/a.toml"] # keep\nversion = 2\n', 'imports = ["/a.toml", "/x/*.toml"] # keep\nversion = 2\n'),
        ('imports = [\n  "/a.toml",  # first\n]\n', 'imports = [\n  "/a.toml",  # first\n  "/x/*.toml",\n]\n'),
        ('imports = [ "/a].toml", ]\n', 'imports = [ "/a].toml", "/x/*.toml" ]\n'),
        (
            '# head\n\nversion = 2 # v\n\n[grpc]\n  address = "x"\n',
            '# head\n\nversion = 2 # v\nimports = ["/x/*.toml"]\n\n[grpc]\n  address = "x"\n',
        ),
        ("# head\noom_score = 0\n[grpc]\n", '# head\noom_score = 0\nimports = ["/x/*.toml"]\n\n[grpc]\n'),
        ("# only a table\n[grpc]\n", '# only a table\nimports = ["/x/*.toml"]\n\n[grpc]\n'),
        ("version = 2", 'version = 2\nimports = ["/x/*.toml"]\n'),
        ("", 'imports = ["/x/*.toml"]\n'),
        ("version = 2\r\n[grpc]\r\n", 'version = 2\r\nimports = ["/x/*.toml"]\r\n\r\n[grpc]\r\n'),
        (
            's = """\n[imports]\nimports = [\n"""\nversion = 2\n',
            's = """\n[imports]\nimports = [\n"""\nversion = 2\nimports = ["/x/*.toml"]\n',
        ),
        ("\"imports\" = ['/a.toml']\n", '"imports" = [\'/a.toml\', "/x/*.toml"]\n'),
        ('[plugins]\nimports = ["/in/a/table"]\n', 'imports = ["/x/*.toml"]\n\n[plugins]\nimports = ["/in/a/table"]\n'),
    ],
)
def test_imports_edit_is_minimal(before, after):
    """tomlkit edits in place: the file's comments and key order stay."""
    assert cc.add_import(Path("/c/config.toml"), before, "/x/*.toml", covers=Path("/x/cgpu.toml")) == after


def test_imports_after_a_comment_without_a_comma_are_rewritten_readably():
    """tomlkit would append without the comma; the array is written anew."""
    before = 'version = 2 # v\nimports = [\n  "/a.toml"\n  # no trailing comma\n]\n'
    after = cc.add_import(Path("/c/config.toml"), before, "/x/*.toml", covers=Path("/x/cgpu.toml"))
    assert tomllib.loads(after) == {"version": 2, "imports": ["/a.toml", "/x/*.toml"]}
    assert after.startswith("version = 2 # v\n")


def test_imports_that_are_not_strings_are_refused():
    with pytest.raises(UsageError, match="imports is not an array of strings"):
        cc.add_import(Path("/c/config.toml"), "imports = [1]\n", "/x/*.toml", covers=Path("/x/cgpu.toml"))


# ---------------------------------------------------------------- TOML writer


_keys = st.text(min_size=1, max_size=8)
_scalars = (
    st.text(max_size=12)
    | st.integers(-(2**63), 2**63 - 1)
    | st.booleans()
    | st.floats(allow_nan=False)
    | st.datetimes()
)
_values = st.recursive(
    _scalars | st.lists(_scalars, max_size=3),
    lambda inner: (
        st.dictionaries(_keys, inner, max_size=4) | st.lists(st.dictionaries(_keys, inner, max_size=3), max_size=3)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=5))
def test_toml_writer_reads_back(doc):
    assert tomllib.loads(cc.dump_toml(doc)) == doc


# ---------------------------------------------------------------- docker


def test_docker_keeps_other_keys_and_runtimes(tmp_path, shim):
    config = tmp_path / "daemon.json"
    original = {
        "log-driver": "json-file",
        "runtimes": {"nvidia": {"path": "nvidia-container-runtime", "runtimeArgs": []}},
        "default-runtime": "runc",
        "storage-driver": "overlay2",
    }
    config.write_text(json.dumps(original))
    out = configure(Engine.DOCKER, config, shim)
    assert f"updated {config} (original kept as {config}.cgpu.bak)" in out
    assert 'reload docker (systemctl reload docker) to load the runtime "cgpu"' in out
    text = config.read_text()
    data = json.loads(text)
    assert list(data) == ["log-driver", "runtimes", "default-runtime", "storage-driver"]
    assert data["runtimes"] == {**original["runtimes"], "cgpu": {"path": str(shim)}}
    assert data["default-runtime"] == "runc"
    assert text == json.dumps(data, indent=4) + "\n"
    assert json.loads((tmp_path / "daemon.json.cgpu.bak").read_text()) == original

    configure(Engine.DOCKER, config, shim, set_as_default=True)
    data = json.loads(config.read_text())
    assert data["default-runtime"] == "cgpu" and list(data) == list(original)
    assert json.loads((tmp_path / "daemon.json.cgpu.bak").read_text()) == original


def test_docker_missing_file_and_twice(tmp_path, shim):
    config = tmp_path / "docker" / "daemon.json"
    out = configure(Engine.DOCKER, config, shim, set_as_default=True)
    assert f"created {config}" in out
    assert json.loads(config.read_text()) == {"runtimes": {"cgpu": {"path": str(shim)}}, "default-runtime": "cgpu"}
    files = snapshot(tmp_path)
    assert configure(Engine.DOCKER, config, shim, set_as_default=True).startswith("already configured")
    assert snapshot(tmp_path) == files


def test_docker_already_configured_file_is_not_reformatted(tmp_path, shim):
    config = tmp_path / "daemon.json"
    config.write_text(json.dumps({"runtimes": {"cgpu": {"path": str(shim)}}}))
    files = snapshot(tmp_path)
    assert configure(Engine.DOCKER, config, shim, dry_run=True) == "no changes\n"
    assert configure(Engine.DOCKER, config, shim).startswith("already configured")
    assert snapshot(tmp_path) == files


def test_docker_bad_json_changes_nothing(tmp_path, shim):
    config = tmp_path / "daemon.json"
    for bad, error in [
        ('{\n  "debug": true,\n}\n', rf"{config} is not valid JSON: .* at line 3 column 1"),
        ("[]", "does not hold a JSON object"),
        ('{"runtimes": []}', '"runtimes" is not a JSON object'),
    ]:
        config.write_text(bad)
        files = snapshot(tmp_path)
        with pytest.raises(UsageError, match=error):
            configure(Engine.DOCKER, config, shim)
        assert snapshot(tmp_path) == files


def test_docker_dry_run(tmp_path, shim):
    config = tmp_path / "daemon.json"
    config.write_text('{"debug": true}')
    out = configure(Engine.DOCKER, config, shim, dry_run=True)
    assert config.read_text() == '{"debug": true}'
    assert out.startswith(f"--- {config}\n+++ {config} (cgpu)\n")
    assert f'+            "path": "{shim}"\n' in out


# ---------------------------------------------------------------- arguments and CLI


def test_runtime_path_must_be_an_absolute_executable(tmp_path, shim):
    assert rc.check_runtime_path(str(shim)) == shim
    with pytest.raises(UsageError, match="not an absolute path"):
        rc.check_runtime_path("bin/cgpu-runtime")
    with pytest.raises(UsageError, match="not an existing file"):
        rc.check_runtime_path(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="not an existing file"):
        rc.check_runtime_path(str(tmp_path))
    plain = tmp_path / "plain"
    plain.write_text("")
    plain.chmod(0o644)  # no x bit at all: not executable even for root
    with pytest.raises(UsageError, match="not executable"):
        rc.check_runtime_path(str(plain))
    # Through a link, the shim proper is looked for beside the real file.
    (tmp_path / "usr-bin").mkdir()
    link = tmp_path / "usr-bin" / "cgpu-runtime"
    link.symlink_to(shim)
    assert rc.check_runtime_path(str(link)) == link
    shim.with_name("cgpu-runtime-gpu").unlink()
    with pytest.raises(UsageError, match="no executable cgpu-runtime-gpu beside .*GPU containers would fail"):
        rc.check_runtime_path(str(link))


@pytest.mark.parametrize("name", ["", "Cgpu", "a b", "x.y", "runc"])
def test_bad_runtime_names(name):
    with pytest.raises(UsageError, match="runtime name"):
        rc.check_name(name)


def test_cli_configures_containerd(tmp_path, shim, capsys):
    config = tmp_path / "config.toml"
    config.write_text("version = 2\n")
    args = [
        "runtime",
        "configure",
        "--containerd",
        "--config",
        str(config),
        "--runtime-path",
        str(shim),
        "--name",
        "gpu-share",
        "--set-as-default",
    ]
    assert main([*args, "--dry-run"]) == 0
    assert "+++ " in capsys.readouterr().out and not (tmp_path / "conf.d").exists()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert 'to load the runtime "gpu-share"' in out
    dropin = tomllib.loads((tmp_path / "conf.d" / "cgpu.toml").read_text())
    containerd = dropin["plugins"][CRI]["containerd"]
    assert containerd["default_runtime_name"] == "gpu-share"
    assert containerd["runtimes"]["gpu-share"]["options"]["BinaryName"] == str(shim)
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("already configured")


def test_cli_default_runtime_path_is_the_installed_shim(tmp_path, capsys):
    from cgpud.native import native_path

    config = tmp_path / "daemon.json"
    assert main(["runtime", "configure", "--docker", "--config", str(config)]) == 0
    assert json.loads(config.read_text())["runtimes"]["cgpu"]["path"] == str(native_path("bin/cgpu-runtime"))


def test_cli_errors(tmp_path, shim, capsys):
    config = tmp_path / "daemon.json"
    config.write_text("{")
    assert main(["runtime", "configure", "--docker", "--config", str(config), "--runtime-path", str(shim)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"cgpuctl: {config} is not valid JSON") and err.count("\n") == 1
    assert main(["runtime", "configure", "--docker", "--runtime-path", "relative"]) == 1
    assert "not an absolute path" in capsys.readouterr().err
    for bad in ([], ["--docker", "--containerd"]):
        with pytest.raises(SystemExit) as e:
            main(["runtime", "configure", *bad])
        assert e.value.code == 2
    assert "one of the arguments --containerd --docker --nvidia-toolkit is required" in capsys.readouterr().err


TOOLKIT_TOML = """disable-require = false
#swarm-resource = "DOCKER_RESOURCE_GPU"
accept-nvidia-visible-devices-envvar-when-unprivileged = true

[nvidia-container-cli]
environment = []
ldconfig = "@/sbin/ldconfig"

[nvidia-container-runtime]
mode = "auto"
"""


def test_the_nvidia_toolkit_is_set_to_take_gpus_from_device_lists_only(tmp_path, capsys):
    """What closes the Kubernetes path of "a GPU without an instance": the
    toolkit ignores NVIDIA_VISIBLE_DEVICES in unprivileged containers and
    reads the list cgpud's Allocate mounts. Every other line is kept; a
    second run changes nothing; a dry run writes nothing."""
    config = tmp_path / "config.toml"
    config.write_text(TOOLKIT_TOML)
    assert main(["runtime", "configure", "--nvidia-toolkit", "--config", str(config), "--dry-run"]) == 0
    assert "+accept-nvidia-visible-devices-as-volume-mounts = true" in capsys.readouterr().out
    assert config.read_text() == TOOLKIT_TOML
    assert main(["runtime", "configure", "--nvidia-toolkit", "--config", str(config)]) == 0
    assert "ignores NVIDIA_VISIBLE_DEVICES in unprivileged containers" in capsys.readouterr().out
    text = config.read_text()
    import tomllib

    got = tomllib.loads(text)
    assert got["accept-nvidia-visible-devices-envvar-when-unprivileged"] is False
    assert got["accept-nvidia-visible-devices-as-volume-mounts"] is True
    assert got["nvidia-container-runtime"] == {"mode": "auto"} and got["disable-require"] is False
    assert '#swarm-resource = "DOCKER_RESOURCE_GPU"' in text  # comments kept
    assert (tmp_path / "config.toml.cgpu.bak").read_text() == TOOLKIT_TOML
    assert main(["runtime", "configure", "--nvidia-toolkit", "--config", str(config)]) == 0
    assert "already configured" in capsys.readouterr().out and config.read_text() == text
    config.write_text("not = [toml")
    assert main(["runtime", "configure", "--nvidia-toolkit", "--config", str(config)]) == 1
    assert "is not TOML" in capsys.readouterr().err and config.read_text() == "not = [toml"
    assert main(["runtime", "configure", "--nvidia-toolkit", "--name", "x", "--config", str(config)]) == 1
    assert "are for --containerd and --docker" in capsys.readouterr().err


def test_cli_malformed_daemon_json_is_one_error_and_nothing_is_written(tmp_path, shim, capsys):
    config = tmp_path / "daemon.json"
    config.write_text('{\n  "runtimes": {"nvidia": {"path": "nvidia-container-runtime"}},\n}\n')
    files = snapshot(tmp_path)
    assert main(["runtime", "configure", "--docker", "--config", str(config), "--runtime-path", str(shim)]) != 0
    err = capsys.readouterr().err
    # The JSON error's wording varies with the Python version; its place does not.
    assert err.startswith(f"cgpuctl: {config} is not valid JSON: ") and err.count("\n") == 1
    assert err.endswith(" at line 3 column 1; fix it first, nothing was changed\n")
    assert snapshot(tmp_path) == files


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("{", "{path} is not valid JSON: "),
        ("[]", "{path} does not hold a JSON object"),
        ('{"runtimes": {}}', "no containerd or docker runtime entry for cgpu"),
        (None, "no containerd or docker runtime entry for cgpu"),
    ],
)
def test_doctor_reports_a_malformed_daemon_json_as_malformed(tmp_path, monkeypatch, text, detail):
    from cgpud.cli import doctor

    path = tmp_path / "daemon.json"
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(doctor, "DOCKER_CONFIG", path)
    monkeypatch.setattr(doctor, "CONTAINERD_DROPINS", tmp_path / "no-conf.d")
    with pytest.raises(CgpuError) as e:
        doctor._runtime()
    assert str(e.value).startswith(detail.format(path=path))


def test_doctor_finds_the_docker_entry(tmp_path, monkeypatch, shim):
    from cgpud.cli import doctor

    path = tmp_path / "daemon.json"
    path.write_text(json.dumps({"runtimes": {"cgpu": {"path": str(shim)}}}))
    monkeypatch.setattr(doctor, "DOCKER_CONFIG", path)
    monkeypatch.setattr(doctor, "CONTAINERD_DROPINS", tmp_path / "no-conf.d")
    assert doctor._runtime() == f'docker: runtime "cgpu" runs {shim} ({path})'


def test_doctor_finds_a_renamed_docker_entry_and_containerd_too(tmp_path, monkeypatch, shim):
    from cgpud.cli import doctor

    path = tmp_path / "daemon.json"
    path.write_text(json.dumps({"runtimes": {"gpu-share": {"path": str(shim)}, "other": {"path": "runc"}}}))
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "cgpu.toml").write_text("")
    monkeypatch.setattr(doctor, "CONTAINERD_DROPINS", tmp_path / "conf.d")
    assert doctor._runtime([path]) == (
        f'containerd: {tmp_path / "conf.d" / "cgpu.toml"}; docker: runtime "gpu-share" runs {shim} ({path})'
    )


@pytest.mark.parametrize("program", ["{tmp}/gone/cgpu-runtime", "{tmp}/daemon.json", "cgpu-runtime-not-on-path"])
def test_doctor_reports_a_docker_entry_whose_program_is_gone(tmp_path, monkeypatch, program):
    """An upgrade or a moved tree leaves daemon.json naming a program that is
    no longer there: `docker run --runtime cgpu` would fail on every start."""
    from cgpud.cli import doctor

    path = tmp_path / "daemon.json"
    program = program.format(tmp=tmp_path)
    path.write_text(json.dumps({"runtimes": {"cgpu": {"path": program}}}))
    monkeypatch.setattr(doctor, "CONTAINERD_DROPINS", tmp_path / "no-conf.d")
    with pytest.raises(CgpuError) as e:
        doctor._runtime([path])
    assert str(e.value) == (
        f'{path}: runtime "cgpu" runs {program}, which is not an executable file, so '
        "`docker run --runtime cgpu` fails; run: cgpuctl runtime configure --docker"
    )


def test_doctor_reads_the_daemon_json_each_running_dockerd_reads(tmp_path):
    from cgpud.cli import doctor

    proc = tmp_path / "proc"
    for pid, argv in {
        "10": ["/usr/sbin/dockerd", "-H", "fd://", "--config-file", "/srv/docker.json"],
        "11": ["dockerd", "--config-file=conf/d.json"],
        "12": ["/usr/sbin/dockerd", "-H", "fd://"],
        "13": ["/usr/bin/containerd", "--config-file", "/nope"],
        "self": ["dockerd", "--config-file", "/nope"],
    }.items():
        (proc / pid).mkdir(parents=True)
        (proc / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (proc / pid / "cwd").symlink_to(tmp_path / "cwd")
    (proc / "14").mkdir()  # a process that exited while /proc was read
    assert doctor.running_dockerd_configs(proc) == sorted(
        [Path("/srv/docker.json"), tmp_path / "cwd" / "conf" / "d.json", doctor.DOCKER_CONFIG]
    )


@pytest.mark.parametrize(
    "text, ok, detail",
    [
        (None, True, "not installed"),
        (
            "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"
            "accept-nvidia-visible-devices-as-volume-mounts = true\n",
            True,
            "only from the device lists",
        ),
        (
            "",
            False,
            "lacks accept-nvidia-visible-devices-envvar-when-unprivileged = false, "
            "accept-nvidia-visible-devices-as-volume-mounts = true",
        ),
        (
            "accept-nvidia-visible-devices-envvar-when-unprivileged = true\n"
            "accept-nvidia-visible-devices-as-volume-mounts = true\n",
            False,
            "gets every GPU without an instance",
        ),
        ("[nvidia-container-cli\n", False, "is not TOML"),
    ],
)
def test_doctor_checks_that_the_nvidia_toolkit_ignores_the_visible_devices_variable(tmp_path, text, ok, detail):
    from cgpud.cli import doctor
    from cgpud.errors import CgpuError

    path = tmp_path / "config.toml"
    if text is not None:
        path.write_text(text)
    check = doctor._toolkit(path)
    if ok:
        assert detail in check()
    else:
        with pytest.raises(CgpuError, match=detail.replace("(", r"\(")):
            check()


def test_the_toolkit_config_configure_writes_passes_the_doctor(tmp_path):
    from cgpud.cli.toolkit_config import toolkit_changes, toolkit_gaps

    path = tmp_path / "config.toml"
    before = (
        '[nvidia-container-cli]\nldconfig = "@/sbin/ldconfig"\naccept-nvidia-visible-devices-as-volume-mounts = false\n'
    )
    assert len(toolkit_gaps(path, before)) == 2
    [change] = toolkit_changes(path, before)
    assert toolkit_gaps(path, change.new) == []
