"""The scale-out doors (docs/scale-out.md): tokens in and out for routers and disaggregated setups."""
