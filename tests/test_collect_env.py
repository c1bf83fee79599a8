"""`petrel env`: the report a bug report starts with says what the kernels themselves decide, and hides secrets."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from petrel import collect_env
from petrel.cli import main
from petrel.model import native, quant_kernels


@pytest.fixture()
def petrel_env(capsys):
    """`petrel env ARGS` through petrel.cli.main in this process: (exit code, stdout)."""

    def run(*args):
        code = main(["env", *args])
        return code, capsys.readouterr().out

    return run


def _path(info: dict, isa: str) -> dict:
    return next(p for p in info["isa_paths"] if p["isa"] == isa)


def test_json_report_matches_the_install_and_the_kernels_decisions(petrel_env):
    code, out = petrel_env("--json")
    assert code == 0
    info = json.loads(out)
    assert info["petrel"]["version"] == "0.1.0"
    for name in ("torch", "transformers", "tokenizers", "gguf", "xgrammar"):
        assert info["packages"][name] == importlib.metadata.version(name), name
    assert info["cpu"]["model"] == collect_env.cpu_model()
    loaded, where = native.kernels_status()
    assert info["kernels"]["loaded"] == loaded
    assert where in json.dumps(info["kernels"])
    assert _path(info, "AVX2 + FMA")["cpu"] == {"avx2": native.cpu_has("avx2"), "fma": native.cpu_has("fma")}
    assert _path(info, "AVX-512")["used"] == (native.cpu_has_avx512() and loaded)
    vnni = quant_kernels.int8_isa() == quant_kernels.INT8_AVX512_VNNI
    assert _path(info, "AVX512_VNNI")["used"] == (vnni and loaded)
    assert set(_path(info, "AMX")["cpu"]) == {"amx_tile", "amx_bf16", "amx_int8"}
    assert info["threads"]["torch_intra_op"] >= 1
    assert info["gpu"]["available"] in (True, False)


def test_text_report_names_every_section(petrel_env):
    code, out = petrel_env()
    assert code == 0
    for heading in ("petrel ", "Python", "OS", "CPU", "torch CPU capability", "transformers", "AVX-512", "AMX"):
        assert heading in out, heading
    for heading in ("C kernels", "threads", "PETREL_* variables", "GPU"):
        assert heading in out, heading


def test_a_switch_that_turns_avx512_off_is_reported_by_name(petrel_env, monkeypatch):
    monkeypatch.setenv("PETREL_AVX512", "0")
    info = json.loads(petrel_env("--json")[1])
    avx512 = _path(info, "AVX-512")
    assert avx512["used"] is False
    if native.cpu_has("avx512f"):
        assert "PETREL_AVX512=0" in avx512["petrel"]
        assert _path(info, "AVX512_VNNI")["used"] is False  # the VNNI blocks are AVX-512 code
    else:
        assert "not on this CPU" in avx512["petrel"]
    assert info["petrel_environment"]["PETREL_AVX512"] == "0"


def test_secrets_in_petrel_variables_are_hidden(petrel_env, monkeypatch):
    secrets = {
        "PETREL_KV_TRANSFER_SECRET": "hunter2-transfer",
        "PETREL_API_KEY": "sk-hunter2-key",
        "PETREL_KV_STORE_URL": "redis://:hunter2-password@store:6379/0",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PETREL_GEMM", "torch")
    for args in ((), ("--json",)):
        out = petrel_env(*args)[1]
        assert "hunter2" not in out
        for name in secrets:
            assert name in out
        assert "PETREL_GEMM" in out and "torch" in out


def test_amx_flags_are_read_as_native_reads_them(monkeypatch):
    amx = frozenset({"avx2", "fma", "amx_tile", "amx_bf16", "amx_int8"})
    monkeypatch.setattr(native, "_cpu_flags", lambda: amx)
    path = _path({"isa_paths": collect_env.isa_paths(kernels_loaded=True)}, "AMX")
    assert path["cpu"] == {"amx_tile": True, "amx_bf16": True, "amx_int8": True} and path["cpu_has"]
    assert path["petrel"]


def test_no_amx_on_a_cpu_without_its_flags(monkeypatch):
    monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    monkeypatch.delenv("PETREL_AMX", raising=False)
    path = _path({"isa_paths": collect_env.isa_paths(kernels_loaded=True)}, "AMX")
    assert path["cpu_has"] is False and path["used"] is False


def test_cpu_model_from_cpuinfo_text():
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: fpu\n"
    assert collect_env.cpu_model(text) == "Intel(R) Xeon(R) Platinum 8480+"


def test_a_gpu_is_named_in_the_text_report():
    info = collect_env.collect()
    info["gpu"] = {
        "torch_cuda": "12.8",
        "available": True,
        "devices": [{"name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8}],
    }
    line = next(line for line in collect_env.render(info).splitlines() if line.startswith("GPU"))
    assert "NVIDIA H200 (compute 9.0, 139.8 GiB)" in line and "CUDA 12.8" in line


def test_help_lists_env(petrel_env, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "env" in capsys.readouterr().out


def test_the_amx_switch_is_reported_by_name(monkeypatch):
    pytest.importorskip("petrel.model.amx")
    monkeypatch.setenv("PETREL_AMX", "0")
    path = _path({"isa_paths": collect_env.isa_paths(kernels_loaded=True)}, "AMX")
    assert path["used"] is False and "PETREL_AMX=0" in path["petrel"]
    monkeypatch.setenv("PETREL_AMX", "force")
    monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    path = _path({"isa_paths": collect_env.isa_paths(kernels_loaded=True)}, "AMX")
    assert path["used"] is False and "no tiles" in path["petrel"]
