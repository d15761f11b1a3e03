"""The upstream side: the pooled client, held GETs, and the pumps that read upstream streams into the
store."""
