"""Builtin autoscaling: the pure decision and its inputs (behavior, trend, scrape, fleet, status), and its loop."""
