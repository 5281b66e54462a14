"""kvpool operator: CRD models, rendering of pools into manifests, kopf handlers."""
