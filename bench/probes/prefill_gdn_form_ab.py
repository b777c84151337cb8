"""Probe: `bench prefill` with the chunked GDN in its r35 default form (the output's products inside the scan,
`fuse_output=True`) or in the three-kernel form before it (prep, scan storing entering states and V', output
kernel with the gated norm in it: `fuse_output=False`), one process each, to measure r35's kernel change in the
engine's prompt steps.

    python bench/probes/prefill_gdn_form_ab.py fused|three OUT.json [bench prefill args ...]   # on the H200
"""

import functools
import runpy
import sys

import pallas_kernels.gdn as gdn
import pallas_kernels.gdn_pallas as gdn_pallas

form, out, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
if form not in ("fused", "three"):
    sys.exit(f"form must be 'fused' or 'three', not {form!r}")
if form == "three":  # gdn.py calls the name it imported; the engine's prompt steps all go through gdn.py
    gdn.gdn_chunked_pallas = functools.partial(gdn_pallas.gdn_chunked_pallas, fuse_output=False)
sys.argv = ["jaxgdn.bench", "prefill", "--out", out, *rest]
runpy.run_module("jaxgdn.bench", run_name="__main__")
