"""The Python and C++ homes of the shared constants and op schemas agree.

spin_trtllm/limits.py and cpp/include/spin/spin_kernels.h hold the same constants; the op
schemas of spin_trtllm/ops (the `spin` namespace) and spin_trtllm/csrc/*.cpp (`spin_native`)
must match argument for argument. Each check is also run on a changed copy of one side, so a
check that could not fail would fail here.
"""

import re
from pathlib import Path

import pytest

from spin_trtllm import limits, ops

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "cpp" / "include" / "spin" / "spin_kernels.h"
CSRC = ROOT / "spin_trtllm" / "csrc"

# Python name in spin_trtllm.limits -> C++ constexpr name
CONSTANTS = {"BLOCK_SLOTS": "kBlockSize", "MAX_NEXT_N": "kMaxNextN", "INDEX_HEADS": "kHeads",
             "HEAD_DIM": "kHeadDim", "SLOT_BYTES": "kSlotBytes", "SUMMARY_BYTES": "kSummaryBytes",
             "MAX_SORTED_K": "kMaxSortedK", "MAX_HYBRID_BLOCKS": "kMaxHybridBlocks",
             "MAX_M_CAP": "kMaxMCap", "MAX_LAUNCH_BATCH": "kMaxGridYZ",
             "DEEPGEMM_SPLIT_KV": "kDeepGemmSplitKv", "FP4_BLOCK": "kFp4Block",
             "FP4_SLOT_BYTES": "kFp4SlotBytes", "GAUSS_SUMMARY_BYTES": "kGaussSummaryBytes",
             "MAX_INDEX_TOPK": "kMaxIndexTopK", "TOPK_FILTER_SLICE_SLOTS": "kFilterSliceSlots",
             "TOPK_FILTER_MAX_SLOTS": "kFilterMaxSlots", "TOPK_FILTER_MAX_K": "kFilterMaxK",
             "TOPK_FILTER_MAX_ROWS": "kFilterMaxRows",
             "TOPK_FILTER_AUTO_MIN_ROWS": "kFilterAutoMinRows",
             "TOPK_FILTER_AUTO_MAX_ROWS": "kFilterAutoMaxRows",
             "TOPK_FILTER_AUTO_MIN_SLOTS": "kFilterAutoMinSlots"}
# Python dict/tuple in spin_trtllm.limits -> C++ enum (enumerators in value order)
ENUMS = {"POOLING": "Pooling", "EXPLORATION_POLICY": "ExplorePolicy", "STATE_DTYPES": "StateType"}


def cpp_constants(text: str) -> dict[str, int]:
    """`constexpr <int type> kName = <integer expression of earlier constants>;`"""
    values: dict[str, int] = {}
    for name, expr in re.findall(r"constexpr\s+(?:u?int\w*|long|unsigned)\s+(k\w+)\s*=\s*([^;]+);",
                                 text):
        expr = re.sub(r"//.*", "", expr).strip()
        if not re.fullmatch(r"[\w\s+\-*/()<]+", expr):
            continue
        values[name] = int(eval(expr, {"__builtins__": {}}, dict(values)))  # noqa: S307
    return values


def cpp_enums(text: str) -> dict[str, dict[str, int]]:
    enums = {}
    for name, body in re.findall(r"enum\s+(?:class\s+)?(\w+)\s*:\s*\w+\s*\{([^}]*)\}", text):
        members = {}
        for member, value in re.findall(r"(k\w+)\s*=\s*(\d+)", re.sub(r"//.*", "", body)):
            members[member] = int(value)
        enums[name] = members
    return enums


def native_schemas(texts: list[str]) -> dict[str, str]:
    """Every m.def("...") schema (adjacent string literals joined) of the binding files."""
    schemas = {}
    for text in texts:
        for call in re.findall(r"m\.def\(\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)", text):
            schema = "".join(re.findall(r"\"((?:[^\"\\]|\\.)*)\"", call))
            schemas[schema.split("(", 1)[0]] = schema
    schemas.pop("abi_version", None)
    return schemas


def normalize(schema: str) -> str:
    return re.sub(r"\s+", " ", schema).replace("( ", "(").replace(" )", ")").strip()


def constant_mismatches(py: dict, cpp_values: dict, cpp_enum: dict) -> list[str]:
    bad = [f"{py_name}={py[py_name]} but {cpp_name}={cpp_values.get(cpp_name)}"
           for py_name, cpp_name in CONSTANTS.items() if cpp_values.get(cpp_name) != py[py_name]]
    for py_name, enum in ENUMS.items():
        ordered = sorted(cpp_enum.get(enum, {}).values())
        values = list(py[py_name].values()) if isinstance(py[py_name], dict) \
            else list(range(len(py[py_name])))
        if ordered != sorted(values) or len(values) != len(cpp_enum.get(enum, {})):
            bad.append(f"{py_name}={py[py_name]} but enum {enum}={cpp_enum.get(enum)}")
    return bad


def schema_mismatches(py: dict[str, str], native: dict[str, str]) -> list[str]:
    python_only = ops.REFERENCE_ONLY    # torch ops on every device: no kernel
    bad = [f"spin::{name} has no native schema" for name in set(py) - set(native) - python_only]
    bad += [f"spin_native::{name} has no Python schema" for name in set(native) - set(py)]
    bad += [f"{name}: Python {normalize(py[name])!r} != native {normalize(native[name])!r}"
            for name in set(py) & set(native) if normalize(py[name]) != normalize(native[name])]
    return bad


def python_limits() -> dict:
    return {name: getattr(limits, name) for name in list(CONSTANTS) + list(ENUMS)}


def binding_texts() -> list[str]:
    return [p.read_text() for p in sorted(CSRC.glob("*.cpp"))]


def test_constants_agree_with_the_kernel_header():
    text = HEADER.read_text()
    assert constant_mismatches(python_limits(), cpp_constants(text), cpp_enums(text)) == []


def test_native_abi_agrees_with_the_binding():
    found = [int(v) for t in binding_texts() for v in re.findall(r"kAbiVersion\s*=\s*(\d+)", t)]
    assert found == [limits.NATIVE_ABI]


def test_op_schemas_agree_with_the_binding():
    native = native_schemas(binding_texts())
    assert len(native) >= 8
    assert schema_mismatches(ops.SCHEMAS, native) == []


@pytest.mark.parametrize("side", ["python", "cpp"])
def test_a_constant_changed_on_one_side_is_caught(side):
    text = HEADER.read_text()
    py, values, enums = python_limits(), cpp_constants(text), cpp_enums(text)
    if side == "python":
        py["MAX_NEXT_N"] += 1
    else:
        values = dict(values, kBlockSize=values["kBlockSize"] * 2)
        enums = {k: dict(v) for k, v in enums.items()}
        enums["Pooling"].popitem()
    assert len(constant_mismatches(py, values, enums)) == (1 if side == "python" else 2)


@pytest.mark.parametrize("side", ["python", "cpp"])
def test_a_schema_changed_on_one_side_is_caught(side):
    py, native = dict(ops.SCHEMAS), native_schemas(binding_texts())
    if side == "python":
        py["topk"] = py["topk"].replace("int next_n", "int rows")
    else:
        native["select"] = native["select"].replace("float exploration", "float gamma")
    assert len(schema_mismatches(py, native)) == 1
