//! API errors and their `Status` encoding, as the real API server sends them (pure).

use serde_json::{Value, json};

/// An error the fake answers with: a `meta/v1 Status` with `code` and `reason`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} ({code}): {message}")]
pub struct ApiError {
    pub code: u16,
    pub reason: String,
    pub message: String,
}

impl ApiError {
    pub fn new(code: u16, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason: reason_for(code).to_owned(),
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }

    pub fn not_found(plural: &str, name: &str) -> Self {
        Self::new(404, format!("{plural} {name:?} not found"))
    }

    /// The watch/list window no longer holds `rv` (410, reason `Expired`).
    pub fn expired(message: impl Into<String>) -> Self {
        Self::new(410, message)
    }

    /// The `Status` object.
    pub fn to_status(&self) -> Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        })
    }
}

/// The `reason` the real server uses with an HTTP status code.
pub fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        409 => "Conflict",
        410 => "Expired",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_carries_code_and_reason() {
        let s = ApiError::expired("too old resource version: 1 (5)").to_status();
        assert_eq!(s["kind"], "Status");
        assert_eq!(s["code"], 410);
        assert_eq!(s["reason"], "Expired");
        assert_eq!(s["message"], "too old resource version: 1 (5)");
    }
}
