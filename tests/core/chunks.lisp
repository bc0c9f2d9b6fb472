;;;; chunks.lisp -- chunked request bodies: malformed framing gets 400, a body
;;;; over the limit 413, and good bodies (extensions, trailers, many chunks,
;;;; Expect: 100-continue) reach the handler intact.  Through each layer: the
;;;; native API, GALLOP:EASY-ACCEPTOR, and GALLOP:TASKMASTER on a stock acceptor.

(in-package #:gallop-tests)

(in-suite core)

(defun chunked-post (framing &rest extra-headers)
  "A POST /body request with Transfer-Encoding: chunked and EXTRA-HEADERS,
whose body is FRAMING, the chunked framing as sent (see CRLFS)."
  (concatenate 'string
               (apply #'crlf "POST /body HTTP/1.1" "Host: x" "Transfer-Encoding: chunked"
                      extra-headers)
               framing))

(defun crlfs (&rest parts)
  "PARTS joined, each followed by CRLF."
  (format nil "~{~A~C~C~}" (loop for p in parts append (list p #\Return #\Linefeed))))

(defparameter *bad-chunked-bodies*
  `(("non-hex size" ,(crlfs "zz" "hello" "0" ""))
    ("negative size" ,(crlfs "-5" "hello" "0" ""))
    ("junk after the size" ,(crlfs "5 x" "hello" "0" ""))
    ("size too large to be real" ,(crlfs "ffffffffffffffffffffff" "hello" "0" ""))
    ("empty size line" ,(crlfs "" "hello" "0" ""))
    ("data longer than its size" ,(crlfs "3" "hello" "0" ""))
    ("bare LF after the size" ,(format nil "5~Chello~C~C0~C~C~C~C" #\Linefeed #\Return #\Linefeed
                                       #\Return #\Linefeed #\Return #\Linefeed))
    ("NUL in an extension" ,(crlfs (format nil "5;a~Cb" (code-char 0)) "hello" "0" "")))
  "Name and chunked framing, each malformed.")

(defparameter *good-chunked-bodies*
  `(("one chunk" ,(crlfs "5" "hello" "0" "") "hello")
    ("upper-case hex, several chunks" ,(crlfs "A" "0123456789" "1" "!" "0" "") "0123456789!")
    ;; (chunga, which decodes for Hunchentoot, needs a value for every extension)
    ("extensions and white space" ,(crlfs "5 ;name=value" "hello" "0;x=1" "") "hello")
    ("trailer fields" ,(crlfs "5" "hello" "0" "X-Trailer: yes" "X-Other: 1" "") "hello")
    ("empty body" ,(crlfs "0" "") ""))
  "Name, chunked framing and the body it carries.")

(defun check-chunked-bodies (port)
  (loop for (name framing) in *bad-chunked-bodies*
        do (let ((socket (connect port)))
             (unwind-protect
                  (progn
                    (send socket (chunked-post framing))
                    (let ((response (read-response socket)))
                      (is (and response (= 400 (response-status response)))
                          "~A: expected 400, got ~S" name (and response (response-status response))))
                    (is (closed-by-peer-p socket) "~A: connection not closed" name))
               (usocket:socket-close socket))))
  (loop for (name framing body) in *good-chunked-bodies*
        do (let ((response (request port (chunked-post framing))))
             (is (and response (= 200 (response-status response))
                      (search body (body-string response)))
                 "~A: ~S" name (and response (body-string response)))))
  ;; Over the limit of 1000 bytes: 413 once the chunks add up past it.
  (let ((socket (connect port)))
    (unwind-protect
         (progn
           (send socket (chunked-post (crlfs "200" (make-string 512 :initial-element #\a)
                                             "200" (make-string 512 :initial-element #\b)
                                             "0" "")))
           (let ((response (read-response socket)))
             (is (and response (= 413 (response-status response)))
                 "over the limit: ~S" (and response (response-status response)))))
      (usocket:socket-close socket)))
  ;; Expect: 100-continue: the client waits for 100 before sending the body.
  (let ((socket (connect port)))
    (unwind-protect
         (progn
           (send socket (chunked-post "" "Expect: 100-continue"))
           (let ((interim (read-response socket :head-only t)))
             (is (and interim (= 100 (response-status interim)))))
           (send socket (crlfs "5" "hello" "0" ""))
           (let ((response (loop for r = (read-response socket)
                                 while (and r (= 100 (response-status r)))
                                 finally (return r))))
             (is (and response (= 200 (response-status response))
                      (search "hello" (body-string response))))))
      (usocket:socket-close socket)))
  (is (= 200 (response-status (get-request port "/yo")))))

(test native-chunked-request-bodies
  (with-app (server #'big-body-app :max-body-bytes 1000)
    (check-chunked-bodies (native-port server))))

(test easy-acceptor-chunked-request-bodies
  (let ((log (make-string-output-stream)))
    (with-server (server 'gallop:easy-acceptor
                         :taskmaster (make-instance 'gallop:taskmaster :max-body-bytes 1000)
                         :message-log-destination log)
      (check-chunked-bodies (port-of server)))
    ;; Bad framing is the client's doing: nothing logged.
    (is (not (search "ERROR" (get-output-stream-string log))))))

(test taskmaster-chunked-request-bodies
  (with-server (server 'hunchentoot:easy-acceptor
                       :taskmaster (make-instance 'gallop:taskmaster :max-body-bytes 1000))
    (check-chunked-bodies (port-of server))))
