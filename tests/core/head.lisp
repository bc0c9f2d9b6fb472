;;;; head.lisp -- malformed and dangerous request heads get a clear error
;;;; before any handler runs, and the server keeps serving.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: ERROR-RESPONSE and METHOD-
;;;; SYMBOL (engine.lisp, http/head.lisp): the answers expected are the
;;;; core's pre-encoded ones, octet for octet.

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
    ("two Host headers in HTTP/1.0" 400 ,(raw-lines "GET / HTTP/1.0" "Host: a" "Host: a"))
    ;; One reading of line ends: CRLF, nothing else (RFC 9112, 2.2).
    ("bare LF ending every line" 400 ,(format nil "GET / HTTP/1.1~CHost: x~C~C" #\Linefeed #\Linefeed #\Linefeed))
    ("bare LF ending the request line" 400 ,(format nil "GET / HTTP/1.1~CHost: x~C~C~C~C"
                                                   #\Linefeed #\Return #\Linefeed #\Return #\Linefeed))
    ("bare LF hiding a Content-Length" 400
     ,(format nil "POST / HTTP/1.1~C~CHost: x~C~Cx:x~CContent-Length: 5~C~C~C~Chello"
              #\Return #\Linefeed #\Return #\Linefeed #\Linefeed #\Return #\Linefeed #\Return #\Linefeed))
    ("bare LF ending the head" 400 ,(format nil "GET / HTTP/1.1~C~CHost: x~C~C~C"
                                            #\Return #\Linefeed #\Return #\Linefeed #\Linefeed))
    ("bare CR inside a header line" 400 ,(raw-lines "GET / HTTP/1.1" "Host: x" (format nil "X-A: a~Cb" #\Return)))
    ("bare CR ending a header line" 400 ,(format nil "GET / HTTP/1.1~C~CHost: x~CX-A: b~C~C~C~C"
                                                 #\Return #\Linefeed #\Return #\Return #\Linefeed #\Return #\Linefeed))
    ("bare CR in the request line" 400 ,(raw-lines (format nil "GET /~C HTTP/1.1" #\Return) "Host: x"))
    ;; A few empty lines before a request are skipped (good-heads-pass); past
    ;; eight they are a malformed head, so CRLFs alone can't hold a connection.
    ("nine empty lines before the request line" 400
     ,(format nil "~{~A~}~A" (loop repeat 9 collect (format nil "~C~C" #\Return #\Linefeed))
              (raw-lines "GET / HTTP/1.1" "Host: x")))
    ("lone LF before the request line" 400 ,(format nil "~C~A" #\Linefeed (raw-lines "GET / HTTP/1.1" "Host: x")))
    ("Transfer-Encoding list" 501 ,(raw-lines "POST / HTTP/1.1" "Host: x" "Transfer-Encoding: gzip, chunked"))
    ("Transfer-Encoding chunked twice in a list" 501 ,(raw-lines "POST / HTTP/1.1" "Host: x" "Transfer-Encoding: chunked, chunked")))
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

(defparameter *bad-request-lines*
  `(("an HTTP/0.9 request" 400 ,(format nil "GET /fast~C~C" #\Return #\Linefeed))
    ("no version, bare LF" 400 ,(format nil "GET /~C" #\Linefeed))
    ("garbage" 400 ,(format nil "HELLO THERE~C~C" #\Return #\Linefeed))
    ("a version after the target and more" 400 ,(format nil "GET / HTTP/1.1 x~C~C" #\Return #\Linefeed))
    ("version 2" 505 ,(format nil "GET / HTTP/2.0~C~C" #\Return #\Linefeed))
    ("nine empty lines" 400 ,(format nil "~{~A~}" (loop repeat 9 collect (format nil "~C~C" #\Return #\Linefeed)))))
  "Request lines that no header line can make valid, sent alone: name,
status, the octets.")

(test request-lines-that-cannot-begin-a-head-are-refused-at-once
  ;; Once its request line is whole, a head that can never be valid is
  ;; refused then, not when the header timeout (a minute here) runs out.
  (with-engine (engine port :header-timeout 60)
    (loop for (name status text) in *bad-request-lines*
          do (let ((socket (connect port :timeout 10)))
               (unwind-protect
                    (progn
                      (send socket text)
                      ;; The answer and the end of the connection, within
                      ;; the 10 s the socket waits, or the read fails.
                      (is (equalp (gallop.core::error-response status)
                                  (coerce (read-to-eof (usocket:socket-stream socket))
                                          '(simple-array (unsigned-byte 8) (*))))
                          "~A: not answered ~D at once" name status))
                 (usocket:socket-close socket))))
    (is (= (length *bad-request-lines*) (engine-stat engine :rejected)))
    ;; A partial head whose request line is good waits for the rest, with
    ;; a line of a few octets or one longer than the early check looks.
    (dolist (target (list "/" (format nil "/~A" (make-string 10000 :initial-element #\a))))
      (let ((socket (connect port)))
        (unwind-protect
             (progn
               (send socket (format nil "GET ~A HTTP/1.1~C~CHost: x~C~C" target
                                    #\Return #\Linefeed #\Return #\Linefeed))
               (is (wait-until (lambda () (plusp (engine-stat engine :head-bytes))))
                   "the partial head was not parked")
               (send socket (format nil "~C~C" #\Return #\Linefeed))
               (is (= 200 (response-status (read-response socket)))))
          (usocket:socket-close socket))))))

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
                        (format nil "~C~C~A" #\Return #\Linefeed (raw-lines "GET / HTTP/1.1" "Host: x"))
                        ;; Any method token reaches the handler (RFC 9110, 9.1).
                        (raw-lines "M-SEARCH * HTTP/1.1" "Host: x")
                        (raw-lines "QUERY /q HTTP/1.1" "Host: x")
                        (raw-lines "BREW /pot HTTP/1.1" "Host: x")
                        (raw-lines "get / HTTP/1.1" "Host: x")))
      (let ((response (request port text)))
        (is (and response (= 200 (response-status response))) "refused: ~S" text)))))

(test a-method-is-a-symbol-of-its-exact-name
  ;; Common methods and methods some code names are keywords; others are
  ;; uninterned symbols of the same name, so clients can't grow KEYWORD.
  (flet ((method-of (string)
           (let ((octets (map '(simple-array (unsigned-byte 8) (*)) #'char-code string)))
             (gallop.core::method-symbol octets 0 (length octets)))))
    (is (eq :get (method-of "GET")))
    (is (eq :m-search (method-of "M-SEARCH")))
    (let ((made-up (method-of "XYZZY-GALLOP-TEST")))
      (is (string= "XYZZY-GALLOP-TEST" (symbol-name made-up)))
      (is (null (symbol-package made-up)))
      (is (null (find-symbol "XYZZY-GALLOP-TEST" :keyword))))
    (is (string= "get" (symbol-name (method-of "get"))))))

(test http-1.0-chunked-bodies-are-read-and-the-connection-closed
  ;; RFC 9112, 6.1: chunked framing in HTTP/1.0 is read, answered, and the
  ;; connection closed after it, on both front ends.
  (let ((text (concatenate 'string
                           (raw-lines "POST /body HTTP/1.0" "Connection: keep-alive"
                                      "Transfer-Encoding: chunked")
                           (crlf "5" "hello" "0" ""))))
    (flet ((check (port)
             (let ((socket (connect port)))
               (unwind-protect
                    (progn
                      (send socket text)
                      (let ((response (read-response socket)))
                        (is (and response (= 200 (response-status response))))
                        (is (equal "5:hello" (and response (body-string response))))
                        (is (equalp "close" (and response (header response "Connection")))))
                      (is (closed-by-peer-p socket)))
                 (usocket:socket-close socket)))))
      (with-app (server #'big-body-app)
        (check (native-port server)))
      (with-server (server 'gallop:easy-acceptor)
        (check (port-of server))))))
