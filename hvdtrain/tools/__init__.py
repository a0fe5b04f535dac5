"""Offline tools around training: plan, bench, report, generate/fill-mask, doctor."""
