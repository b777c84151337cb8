"""The soak benchmark's plot: every server's resident memory, KV pages, GDN slots and snapshots in use, requests
running and waiting, and output tokens/s over the run (matplotlib, one PNG)."""

from __future__ import annotations

from pathlib import Path


def plot_soak(payload: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = payload["samples"]
    t = [s["t"] / 60 for s in samples]
    roles = list(samples[0]["servers"]) if samples else []
    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    panels = [
        ("resident memory, MB (all server processes)", [("RSS", [s["rss_mb"] for s in samples])]),
        ("KV pages", _lines(samples, roles, [("held by requests", "kv_pages_used"),
                                             ("cached only", "kv_pages_cached")])),
        ("GDN request slots in use", _lines(samples, roles, [("", "gdn_slots_used")])),
        ("GDN snapshots (prefix cache)", _lines(samples, roles, [("", "gdn_snapshots_used")])),
        ("requests", _lines(samples, roles, [("running", "requests_running"), ("waiting", "requests_waiting")])),
        ("output tokens/s", [("", _rate(samples, roles))]),
    ]
    for ax, (title, lines) in zip(axes.flat, panels):
        for label, ys in lines:
            ax.plot(t, ys, label=label or None, linewidth=1)
        ax.set_title(title, fontsize=10)
        if any(label for label, _ in lines):
            ax.legend(fontsize=8)
        start, end = (x / 60 for x in payload["traffic_window_s"])
        ax.axvspan(start, end, color="0.93", zorder=0)
    for ax in axes[-1]:
        ax.set_xlabel("minutes (shaded: Poisson traffic)")
    verdict = "passed" if payload["passed"] else "FAILED"
    mode = "PD pair" if payload["config"]["pd"] else "one server"
    fig.suptitle(f"soak, {mode}, {payload['config']['server_args']}: {payload['requests']['sent']} requests, "
                 f"{payload['requests']['errors']} errors, {verdict}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _lines(samples: list[dict], roles: list[str], series: list[tuple[str, str]]) -> list[tuple[str, list[float]]]:
    """One line per (role, series); the role named only when there are several."""
    out = []
    for role in roles:
        for label, key in series:
            name = " ".join(x for x in ((role if len(roles) > 1 else ""), label) if x)
            out.append((name, [s["servers"][role][key] for s in samples]))
    return out


def _rate(samples: list[dict], roles: list[str]) -> list[float]:
    total = [sum(s["servers"][r]["generation_tokens"] for r in roles) for s in samples]
    rates = [0.0]
    for i in range(1, len(samples)):
        dt = samples[i]["t"] - samples[i - 1]["t"]
        rates.append((total[i] - total[i - 1]) / dt if dt > 0 else 0.0)
    return rates
