"""Benchmarks (`python -m jaxgdn.bench --help`): each sub-command prints a table and writes JSON to
bench/results/ with the device, versions and date."""

from .common import RESULTS_DIR, environment, write_result

__all__ = ["RESULTS_DIR", "environment", "write_result"]
