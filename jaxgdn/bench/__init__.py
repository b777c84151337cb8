"""Benchmarks (`python -m jaxgdn.bench --help`): each sub-command prints a table and writes JSON to
bench/results/ with the device, versions and date."""
