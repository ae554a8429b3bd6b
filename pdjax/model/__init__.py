"""Pure-functional DeepSeek-V2/V3 model code (MLA, MoE, latent KV cache, HF loading).

Modules (imported on first use): ``mla``, ``moe``, ``transformer``, ``cache``, ``paged``, ``hf``,
``hf_files``, ``hf_checks``, ``initializers``, ``layer_scan``, ``dots``, ``moe_decode``, ``moe_dispatch``, ``checks``,
``params``, ``sharding``.
"""

import importlib

MODULES = ("cache", "checks", "dots", "hf", "hf_checks", "hf_files", "initializers", "layer_scan", "mla", "moe", "moe_decode",
           "moe_dispatch", "paged", "params", "sharding", "transformer")


def __getattr__(name):
    if name in MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
