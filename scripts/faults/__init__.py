"""The fault campaign of issue 36: faults injected into real `dsx3d train` jobs at seeded random moments."""
