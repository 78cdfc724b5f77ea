mod common;

use hickory_proto::rr::RecordType;
use serde_json::json;

#[tokio::test]
async fn register_then_dns_answers() {
    let server = common::start().await;
    server.register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060})).await;
    let reply = server.query("_voice._tcp.service.koder.", RecordType::SRV).await;
    assert_eq!(reply.answers.len(), 1);
    server.running.shutdown().await;
}
