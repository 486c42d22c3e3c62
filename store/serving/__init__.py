"""The serving side: ``KVLoader`` (``loader``) and its hits (``hit``), the node-wide shared pool
(``pool``) and this process's mappings of it (``mapper``), prefetch (``prefetch``), S3 -> NVMe fetches
(``fetch``) and metrics (``metrics``). A serving node imports this, ``torch`` and its engine: no
Prefect, no statsmodels."""
