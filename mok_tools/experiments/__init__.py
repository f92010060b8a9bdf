"""One-off probes kept runnable (each has a ``main``; tests/test_architecture.py imports every one). Their logs stay
in lab/diagnostics/, whose READMEs name the command that ran."""
