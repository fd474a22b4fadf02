"""Launching ranks: the launch of one run (launch), the warm forkserver (forkserver), the single-node
fork launcher (forkrun) and the rendezvous of multi-node runs (nodes). Worker modules are named by
string; nothing here imports the engine, a backend or the CLI."""
