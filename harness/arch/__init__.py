"""Architecture components: one per feature that models combine (harness/arch/components.py), the model
as a list of them (model.py) and its typed plan over a topology (plan.py). Pure: no torch, no engine."""
