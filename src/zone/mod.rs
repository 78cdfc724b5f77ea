//! The service zone's shape, apart from serving it: its names (`ns.`, `addr.`, the
//! `<hex>.addr` name of an address), the record parts of one instance, and the answers
//! prepared once per service view. The registry keeps these with each view; the DNS
//! server reads them. Depends on the model alone.

pub mod prepared;
pub mod records;
