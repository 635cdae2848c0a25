"""The job file as bridge-submit and every rank read it: torch-free (load, extends, --set, launcher sections, paths)."""
