//! `GET /api/v1/openapi.json`: every route described, and schemathesis (PyPI) finding no
//! server error and no response outside the description against the live server.

use std::process::Command;

use serde_json::Value;

use crate::common::{self, KEY};

#[tokio::test]
async fn openapi_describes_every_route_with_its_errors() {
    let server = common::start().await;
    let (status, doc) = server.get("/api/v1/openapi.json").await;
    assert_eq!(status, 200, "{doc}");
    assert_eq!(doc["openapi"], "3.1.0");
    let paths: Vec<&str> = doc["paths"].as_object().unwrap().keys().map(String::as_str).collect();
    for route in [
        "/api/v1/services",
        "/api/v1/services/register",
        "/api/v1/services/heartbeat",
        "/api/v1/services/deregister",
        "/api/v1/services/export",
        "/api/v1/services/drift",
        "/api/v1/routes",
        "/api/v1/sd/prometheus",
        "/api/v1/openapi.json",
    ] {
        assert!(paths.contains(&route), "{route} is not described: {paths:?}");
    }
    let register = &doc["paths"]["/api/v1/services/register"]["post"];
    for status in ["200", "400", "401", "503", "507"] {
        assert!(
            register["responses"][status].is_object(),
            "register {status}: {register}"
        );
    }
    let error: &Value = &doc["components"]["schemas"]["ErrorBody"];
    assert_eq!(error["required"], serde_json::json!(["error", "message"]), "{error}");
    assert!(doc["components"]["securitySchemes"]["api_key"].is_object());
    // Like the rest of the API, the document needs the key.
    let anonymous = server
        .http
        .get(server.url("/api/v1/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
}

#[tokio::test]
#[ignore = "needs schemathesis (PyPI, installed by tests/run.sh)"]
async fn schemathesis_finds_no_server_error_and_no_response_outside_the_schema() {
    let server = common::start().await;
    let url = server.url("/api/v1/openapi.json");
    // schemathesis keeps a cache in its working directory: not in the repository.
    let scratch = tempfile::tempdir().unwrap();
    let cwd = scratch.path().to_owned();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("schemathesis")
            .current_dir(cwd)
            .args(["run", &url, "--header", &format!("X-API-Key: {KEY}")])
            .args([
                "--checks",
                "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
                "--max-examples",
                "30",
                "--seed",
                "1",
            ])
            .output()
            .expect("run schemathesis (pip install schemathesis)")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("passed"), "{stdout}");
}

/// The document is valid OpenAPI 3.1 by the reference validator, declares how the key is
/// sent, and lists 403 on every route where a key's scope can refuse.
#[tokio::test]
#[ignore = "needs openapi-spec-validator (PyPI, installed by tests/run.sh)"]
async fn the_document_passes_openapi_spec_validator_and_lists_403_where_a_scope_refuses() {
    let server = common::start().await;
    let (status, doc) = server.get("/api/v1/openapi.json").await;
    assert_eq!(status, 200);
    let file = tempfile::NamedTempFile::with_suffix(".json").unwrap();
    std::fs::write(file.path(), doc.to_string()).unwrap();
    let out = Command::new("openapi-spec-validator")
        .arg(file.path())
        .output()
        .expect("run openapi-spec-validator (pip install openapi-spec-validator)");
    assert!(
        out.status.success(),
        "openapi-spec-validator rejects the document:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let schemes = &doc["components"]["securitySchemes"];
    assert_eq!(schemes["api_key"]["type"], "apiKey", "{schemes}");
    assert_eq!(schemes["api_key"]["in"], "header");
    assert_eq!(schemes["api_key"]["name"], "X-API-Key");
    assert_eq!(schemes["bearer"]["scheme"], "bearer", "{schemes}");
    for (path, method) in [
        ("/api/v1/services/register", "post"),
        ("/api/v1/services/heartbeat", "post"),
        ("/api/v1/services/deregister", "post"),
    ] {
        let operation = &doc["paths"][path][method];
        assert!(
            operation["responses"]["403"].is_object(),
            "{method} {path}: {operation}"
        );
    }
}
