"""The uploads' HTTP side: ``/v1/uploads``, their metrics, page and health parts."""
