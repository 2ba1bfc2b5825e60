"""SLED verify server: one shared target model checks the drafts of many devices in batches."""
