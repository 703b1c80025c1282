"""The step loop joining scheduler and model runner, and what surrounds it."""
