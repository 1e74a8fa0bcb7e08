terraform {
  # Provider-free on purpose: everything here is pure computation, so `terraform test`
  # runs it offline with nothing to download.
  required_version = ">= 1.7"
}
