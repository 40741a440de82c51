"""The kind of machine a run ran on, as make tune writes it into the command it tunes (--tuned-on), and what sets two
kinds apart (the health warning `tuned_elsewhere`)."""

import re

from trainscope.core.record_view import RunView

# The CPU's bf16 matmul path, by the native-bf16 flags the record lists (most capable first): AMX tiles, AVX512-BF16
# dot products, ARM's SVE-BF16 and AdvSIMD BF16. torch's CPU capability says AVX512 for AMX and AVX512-BF16 alike,
# though their bf16 peaks differ several-fold (machines B and C: docs/benchmarks.md#the-machines).
BF16_PATHS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("svebf16", "SVE-BF16"), ("bf16", "ARM-BF16"))
NATIVE_PATHS = frozenset(name for _, name in BF16_PATHS) | {"native"}  # "native": a path older strings did not name


def cpu_bf16_path(env: dict) -> str:
    """How this CPU computes bf16 matmuls, from the record's environment: 'AMX', 'AVX512-BF16', 'SVE-BF16',
    'ARM-BF16', 'emulated' (no native-bf16 flag), 'native' (native by a record that names no flag), else 'unknown'
    (the flags could not be read). The flags: the record's `cpu_bf16.flags` and those its `cpu_capability` names."""
    capability = env.get("cpu_capability") or ""
    _, _, rest = capability.replace(" + ", ", ", 1).partition(", ")
    named = {f.strip() for f in rest.split(",") if f.strip() and "no native bf16" not in f}
    flags = named | set((env.get("cpu_bf16") or {}).get("flags") or [])
    for flag, path in BF16_PATHS:
        if flag in flags:
            return path
    native = env.get("cpu_native_bf16")
    if native is None and "cpu_native_bf16" not in env and "no native bf16" in capability:
        native = False  # records older than the cpu_native_bf16 key
    return {True: "native", False: "emulated"}.get(native, "unknown")


def machine_kind(view: RunView) -> str:
    """The device type, its instruction set or compute capability, the bf16 path, the usable cores (what make tune's
    threads and loader workers are sized for; left out where the record lacks them) and the device's name:
    'cpu AVX512, bf16 AMX, 2 cores: Intel(R) Xeon(R) Processor', 'cpu AVX2, bf16 emulated, 2 cores: AMD EPYC'."""
    env = view.env
    if view.on_cuda:
        isa = f"compute capability {env.get('gpu_compute_capability', '?')}"
        bf16 = {True: "native", False: "emulated"}.get(env.get("gpu_native_bf16"), "unknown")
    else:
        isa = re.split(r"[ ,+]", env.get("cpu_capability") or "?", maxsplit=1)[0] or "?"
        bf16 = cpu_bf16_path(env)
    cores = view.machine.cores or view.threads.get("usable_cores")
    counted = f", {cores} core{'s' if cores != 1 else ''}" if cores else ""
    return f"{view.device.split(':')[0] or '?'} {isa}, bf16 {bf16}{counted}: {view.device_name}"


# Older versions wrote 'cpu AVX512, bf16 native: AMD EPYC' (no bf16 path, no cores): each field they lack unknown.
MACHINE_KIND = re.compile(
    r"(?P<device>\S+) (?P<isa>[^,]+), bf16 (?P<bf16>[^,:]+?)(?:, (?P<cores>\d+) cores?)?: (?P<name>.*)"
)


def _bf16_differs(there: str, here: str) -> bool:
    """Two bf16 paths differ unless equal, either unknown, or one is an older string's bare 'native' and the other
    a native path it may have been."""
    if there == here or "unknown" in (there, here):
        return False
    return not ({there, here} <= NATIVE_PATHS and "native" in (there, here))


def kind_difference(tuned_on: str, here: str) -> str | None:
    """What sets the machine here apart from the one a command was tuned on (None: the same kind): the device
    type, the instruction set or compute capability, the bf16 path, the usable cores, and on a GPU its model; a CPU
    model of the same kind is the same kind. A field one side lacks (an older --tuned-on string, a record without
    it) is unknown, not a difference."""
    there, found = MACHINE_KIND.fullmatch(tuned_on.strip()), MACHINE_KIND.fullmatch(here.strip())
    if there is None or found is None:
        return f"'{tuned_on}' is not a machine as make tune writes it, so it cannot be compared"
    differ = [
        f"{'instruction set' if key == 'isa' else key} {there[key]} there, {found[key]} here"
        for key in ["device", "isa"]
        if there[key] != found[key] and "unknown" not in (there[key], found[key])
    ]
    if _bf16_differs(there["bf16"], found["bf16"]):
        differ.append(f"bf16 {there['bf16']} there, {found['bf16']} here")
    if there["cores"] and found["cores"] and there["cores"] != found["cores"]:
        differ.append(f"{there['cores']} core{'s' if there['cores'] != '1' else ''} there, {found['cores']} here")
    if found["device"] == "cuda" and there["name"] != found["name"]:
        differ.append(f"name {there['name']} there, {found['name']} here")
    return "; ".join(differ) or None
