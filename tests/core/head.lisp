;;;; head.lisp -- malformed and dangerous request heads get a clear error
;;;; before any handler runs, and the server keeps serving.

(in-package #:gallop-tests)

(in-suite core)

(defun raw-lines (&rest lines)
  "LINES joined with CRLF, ending the head with an empty line."
  (apply #'crlf lines))

(defparameter *bad-heads*
  `(("garbage request line" 400 ,(raw-lines "HELLO"))
    ("no version" 400 ,(raw-lines "GET /"))
    ("two spaces" 400 ,(raw-lines "GET  / HTTP/1.1" "Host: x"))
    ("bad version" 400 ,(raw-lines "GET / HTTX/1.1" "Host: x"))
    ("version 2" 505 ,(raw-lines "GET / HTTP/2.0" "Host: x"))
    ("version 1.9" 505 ,(raw-lines "GET / HTTP/1.9" "Host: x"))
    ("unknown method" 501 ,(raw-lines "BREW /pot HTTP/1.1" "Host: x"))
    ("lower-case method" 501 ,(raw-lines "get / HTTP/1.1" "Host: x"))
    ("non-token method" 400 ,(raw-lines "GE(T / HTTP/1.1" "Host: x"))
    ("header without colon" 400 ,(raw-lines "GET / HTTP/1.1" "Host: x" "NoColonHere"))
    ("space before colon" 400 ,(raw-lines "GET / HTTP/1.1" "Host : x"))
    ("obsolete line folding" 400 ,(raw-lines "GET / HTTP/1.1" "Host: x" "X-A: b" " continued"))
    ("NUL in a header value" 400 ,(raw-lines "GET / HTTP/1.1" "Host: x" (format nil "X-A: a~Cb" (code-char 0))))
    ("control byte in a header value" 400 ,(raw-lines "GET / HTTP/1.1" "Host: x" (format nil "X-A: a~Cb" (code-char 7))))
    ("control byte in the target" 400 ,(raw-lines (format nil "GET /a~Cb HTTP/1.1" (code-char 1)) "Host: x"))
    ("invalid percent-encoding" 400 ,(raw-lines "GET /a%zzb HTTP/1.1" "Host: x"))
    ("truncated percent-encoding" 400 ,(raw-lines "GET /a% HTTP/1.1" "Host: x"))
    ("negative Content-Length" 400 ,(raw-lines "POST / HTTP/1.1" "Host: x" "Content-Length: -5"))
    ("non-numeric Content-Length" 400 ,(raw-lines "POST / HTTP/1.1" "Host: x" "Content-Length: 12abc"))
    ("huge Content-Length" 400 ,(raw-lines "POST / HTTP/1.1" "Host: x" "Content-Length: 99999999999999999999999"))
    ("conflicting Content-Length" 400 ,(raw-lines "POST / HTTP/1.1" "Host: x" "Content-Length: 5" "Content-Length: 6"))
    ("Transfer-Encoding with Content-Length" 400 ,(raw-lines "POST / HTTP/1.1" "Host: x" "Content-Length: 5" "Transfer-Encoding: chunked"))
    ("Transfer-Encoding twice" 400 ,(raw-lines "POST / HTTP/1.1" "Host: x" "Transfer-Encoding: chunked" "Transfer-Encoding: chunked"))
    ("unknown transfer coding" 501 ,(raw-lines "POST / HTTP/1.1" "Host: x" "Transfer-Encoding: gzip"))
    ("Transfer-Encoding in HTTP/1.0" 400 ,(raw-lines "POST / HTTP/1.0" "Transfer-Encoding: chunked"))
    ("HTTP/1.1 without Host" 400 ,(raw-lines "GET / HTTP/1.1"))
    ("two Host headers" 400 ,(raw-lines "GET / HTTP/1.1" "Host: a" "Host: b"))
    ("body over the limit" 413 ,(raw-lines "POST / HTTP/1.1" "Host: x" "Content-Length: 2000000"))
    ;; Header names in any case are the same header.
    ("two Host headers, case differs" 400 ,(raw-lines "GET / HTTP/1.1" "HOST: a" "host: b"))
    ("conflicting Content-Length, case differs" 400
     ,(raw-lines "POST / HTTP/1.1" "Host: x" "CONTENT-LENGTH: 5" "content-length: 6"))
    ("Transfer-Encoding and Content-Length, case differs" 400
     ,(raw-lines "POST / HTTP/1.1" "Host: x" "content-LENGTH: 5" "TRANSFER-encoding: Chunked"))
    ("HTTP/1.1 with only a Host-like header" 400 ,(raw-lines "GET / HTTP/1.1" "Hostx: a" "Hos: b"))
    ("method with one letter in lower case" 501 ,(raw-lines "GeT / HTTP/1.1" "Host: x")))
  "Name, expected status, and the request head.")

(test malformed-heads-get-clear-errors-and-the-server-keeps-serving
  (with-engine (engine port :max-body-bytes 1000000)
    (loop for (name status text) in *bad-heads*
          do (let ((socket (connect port)))
               (unwind-protect
                    (progn
                      (send socket text)
                      (let ((response (read-response socket)))
                        (is (and response (= status (response-status response)))
                            "~A: expected ~D, got ~S" name status
                            (and response (response-status response)))
                        (when response
                          (is (equalp "close" (header response "Connection")))))
                      (is (closed-by-peer-p socket) "~A: connection not closed" name))
                 (usocket:socket-close socket))))
    (is (= (length *bad-heads*) (engine-stat engine :rejected)))
    (is (zerop (engine-stat engine :requests)) "no bad head reached the handler")
    ;; and the server still serves
    (is (= 200 (response-status (get-request port "/"))))))

(test good-heads-pass
  (with-engine (engine port)
    (dolist (text (list (raw-lines "GET /a%20b?x=%C3%A9 HTTP/1.1" "Host: x")
                        (raw-lines "GET / HTTP/1.0")
                        (raw-lines "OPTIONS * HTTP/1.1" "Host: x")
                        (raw-lines "GET http://x/abs HTTP/1.1" "Host: x")
                        (raw-lines "PROPFIND /dav HTTP/1.1" "Host: x" "Depth: 1")
                        (raw-lines "GET / HTTP/1.1" "host: x" "X-Empty:" "X-Tab:	a	b")
                        (raw-lines "GET / HTTP/1.1" "Host: x" "Content-Length: 0" "Content-Length: 0")
                        (raw-lines "GET / HTTP/1.1" "hOsT: x" "CONTENT-LENGTH: 0" "content-length: 0")
                        (raw-lines "DELETE /x HTTP/1.1" "Host: x")
                        (raw-lines "MKCALENDAR /cal HTTP/1.1" "Host: x")
                        (concatenate 'string
                                     (raw-lines "POST / HTTP/1.1" "Host: x" "TRANSFER-ENCODING: CHUNKED")
                                     (crlf "0" ""))
                        (format nil "~C~C~A" #\Return #\Linefeed (raw-lines "GET / HTTP/1.1" "Host: x"))))
      (let ((response (request port text)))
        (is (and response (= 200 (response-status response))) "refused: ~S" text)))))
