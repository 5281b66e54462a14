"""Storage tiers below the inference engine: G2 DRAM, G3 NVMe, G4 shared store."""
