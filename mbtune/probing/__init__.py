"""The probe's wing: the memory ceiling and safe batch found with real, isolated training trials."""
