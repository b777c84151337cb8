"""Probe: `bench spec` with the GDN pool kernel's r26 settings undone (4 warps at every T, no cache hints; its
T = 1 store path stays the new one) or as it is, one process each, to put the r26 kernel change's share in the
verify step on the record.

    python bench/probes/spec_pool_ab.py old|new OUT.json [bench spec args ...]   # on the H200 (PYTHONPATH=.)
"""

import functools
import runpy
import sys

import jaxgdn.paged_forward as paged_forward
import pallas_kernels.gdn_pallas as gdn_pallas

form, out, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
assert form in ("old", "new"), form
if form == "old":
    gdn_pallas.pool_warps = lambda T: 4
    paged_forward.gdn_recurrent_pooled = functools.partial(gdn_pallas.gdn_recurrent_pooled, evict_first=False)
sys.argv = ["jaxgdn.bench", "spec", "--out", out, *rest]
runpy.run_module("jaxgdn.bench", run_name="__main__")
