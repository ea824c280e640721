"""--engine-choices: the pins of the CPU engine's timed load-time choices, parsed without torch (a
service checks its flags before the model libraries load). `Plan.choices` (engine/plan.py) writes
them; cpu/choose.py makes the choices."""
from __future__ import annotations

PINS = {"attention": ("float32", "model"), "prepack": ("on", "off"), "fp32-prepack": ("on", "off"), "per-row": ("on", "off"),
        "row-kernel": ("on", "off"), "attention-kernel": ("on", "off")}
PIN_KEYWORDS = {name.replace("-", "_"): name for name in PINS}  # parse_choices' keyword -> its --engine-choices name


def parse_choices(text: str | None) -> dict[str, bool | str]:
    """--engine-choices ('attention=float32,prepack=on,per-row=off', any of them; '' for none) ->
    `choose`'s keyword arguments. ValueError names what is wrong."""
    out: dict[str, bool | str] = {}
    for part in filter(None, (x.strip() for x in (text or "").split(","))):
        name, _, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if name not in PINS or value not in PINS[name]:
            raise ValueError(f"--engine-choices: {part!r} is not one of " +
                             ", ".join(f"{n}={'|'.join(v)}" for n, v in PINS.items()))
        key = name.replace("-", "_")
        if key in out:
            raise ValueError(f"--engine-choices: {name} given twice")
        out[key] = value if name == "attention" else value == "on"
    for packed in ("prepack", "fp32_prepack"):
        if out.get(packed) and out.get("per_row"):
            raise ValueError(f"--engine-choices: {packed.replace('_', '-')}=on and per-row=on exclude each other "
                             "(per-row products read the plain weights)")
    return out
