"""Operating a deployment: views of the stored state, audit, ledger, monitor, metrics.

Built on the core (Store, keys, schema); the core never imports from here.
"""
