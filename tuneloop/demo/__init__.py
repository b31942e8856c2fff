"""The embedded demo: its domain, the tiny model, its general skill, customers, report."""
