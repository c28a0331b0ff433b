"""Batch jobs on Apache Spark (PySpark): the delivery audit, bulk scheduling and the load forecast
(ARCHITECTURE.md section 9). Each module is a thin ``main`` around pure DataFrame functions."""
