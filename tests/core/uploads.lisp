;;;; uploads.lisp -- request bodies adding up to more than twice the
;;;; server's whole heap, arriving at once, through GALLOP:START and
;;;; GALLOP:EASY-ACCEPTOR: the server stays up and answers every request
;;;; correctly.
;;;;
;;;; The server runs in a child process (tests/child/upload-server.lisp) with
;;;; a 256 MiB heap (sbcl --dynamic-space-size 256MB), so that a server that
;;;; held the bodies in memory would exhaust it: SBCL's runtime then dies
;;;; (--lose-on-corruption, no ldb) or the requests fail.  Up to seventeen
;;;; clients connect at once: ten upload 64,000,000-octet bodies to /upload
;;;; (which reads and counts them), with Content-Length, chunked in 64 KiB
;;;; chunks, and chunked in a single 64,000,000-octet chunk (640 MB in all,
;;;; 2.4 times the heap); four send such bodies to /ignore (which never
;;;; reads them); three more to /stream, whose handler answers without
;;;; reading the body (the easy-acceptor's through HUNCHENTOOT:SEND-HEADERS)
;;;; and whose bodies the server streams to the handler (:STREAMED-BODIES)
;;;; instead of reading them first into temporary files, as it does the
;;;; others.  Each client reads its answer strictly (tests/native/bodies.lisp's
;;;; READ-EXACT-RESPONSE: status line, every header line, Content-Length
;;;; equal to the body) and checks the body: the octet count, "ignored" or
;;;; "streamed".  An /upload or /ignore client then sends GET / on the same
;;;; connection and must get "ok" (the body was consumed exactly, by the
;;;; handler or by the server before it); /stream clients must see the
;;;; server close the connection, since their bodies had not all arrived.
;;;; Then a plain GET / on a new connection, and the child must have logged
;;;; nothing.
;;;;
;;;; Bounded: every read and write of a client waits at most 60 s, and if
;;;; the clients are not done in 90 s the child is killed, which ends them.

(in-package #:gallop-tests)

(in-suite core)

(defparameter *upload-body-bytes* 64000000
  "Octets per body: under :MAX-BODY-BYTES's default (64 MiB).")

(defparameter *upload-child-heap* "256MB"
  "The child's --dynamic-space-size.")

(defparameter *upload-pattern*
  (let ((rng (sb-ext:seed-random-state 13))
        (pattern (make-array 65536 :element-type '(unsigned-byte 8))))
    (dotimes (i (length pattern) pattern)
      (setf (aref pattern i) (random 256 rng))))
  "The 64 KiB every body repeats: every octet value, CR and LF included.")

;;; The child server

(defun start-upload-child (kind log stderr)
  "Start tests/child/upload-server.lisp as KIND with a small heap, logging
to LOG.  (values process port dynamic-space-size), PORT NIL when it did not
say READY within 120 s."
  (let* ((process (sb-ext:run-program
                   "sbcl" (list "--dynamic-space-size" *upload-child-heap*
                                "--disable-ldb" "--lose-on-corruption" "--noinform"
                                "--non-interactive" "--no-userinit"
                                ;; What scripts/lisp.sh does.
                                "--eval" "(require :asdf)"
                                "--eval" "(push (uiop:getcwd) asdf:*central-registry*)"
                                "--eval" "(setf *compile-verbose* nil *compile-print* nil)"
                                "--load" "tests/child/upload-server.lisp"
                                "--end-toplevel-options" kind (namestring log))
                   :search t :wait nil :input :stream :output :stream
                   :error (namestring stderr) :if-error-exists :supersede
                   :directory (namestring (asdf:system-source-directory "gallop"))))
         (output (sb-ext:process-output process))
         (line (and (sb-sys:wait-until-fd-usable (sb-sys:fd-stream-fd output) :input 120)
                    (read-line output nil ""))))
    (if (and line (uiop:string-prefix-p "READY " line))
        (with-input-from-string (in line :start 6)
          (values process (read in) (read in)))
        (values process nil nil))))

(defun end-upload-child (process)
  "Tell the child to quit; kill it if it does not within 10 s."
  (ignore-errors (write-line "quit" (sb-ext:process-input process))
                 (finish-output (sb-ext:process-input process)))
  (unless (wait-until (lambda () (not (sb-ext:process-alive-p process))) :timeout 10)
    (ignore-errors (sb-ext:process-kill process 9))
    (wait-until (lambda () (not (sb-ext:process-alive-p process))) :timeout 10))
  (ignore-errors (sb-ext:process-close process)))

(defun file-text (path)
  (if (probe-file path) (uiop:read-file-string path) ""))

;;; One client

(defun upload-head (path framing)
  (crlf (format nil "POST ~A HTTP/1.1" path) "Host: 127.0.0.1"
        "Content-Type: application/octet-stream"
        (if (eq framing :length)
            (format nil "Content-Length: ~D" *upload-body-bytes*)
            "Transfer-Encoding: chunked")))

(defun send-upload-body (stream framing)
  "Write the body (*UPLOAD-BODY-BYTES* octets of the pattern) framed as
FRAMING (:LENGTH, :CHUNKED in 64 KiB chunks, :ONE-CHUNK), looking for an
answer before every 64 KiB: stop as soon as one arrived."
  (flet ((put (string) (write-sequence (octets string) stream)))
    (when (eq framing :one-chunk)
      (put (format nil "~X~C~C" *upload-body-bytes* #\Return #\Linefeed)))
    (loop for start from 0 below *upload-body-bytes* by (length *upload-pattern*)
          for n = (min (length *upload-pattern*) (- *upload-body-bytes* start))
          do (when (listen stream)
               (return-from send-upload-body))
             (when (eq framing :chunked)
               (put (format nil "~X~C~C" n #\Return #\Linefeed)))
             (write-sequence *upload-pattern* stream :end n)
             (when (eq framing :chunked)
               (put (crlf)))
             (finish-output stream))
    (when (eq framing :one-chunk)
      (put (crlf)))                     ; the end of the one chunk's data
    (unless (eq framing :length)
      (put (crlf "0")))                 ; the last chunk and the empty trailer section
    (finish-output stream)))

(defun check-exact-answer (response body)
  "NIL if RESPONSE is a 200 with a Content-Length framed BODY, else what is
wrong."
  (let ((got (map 'string #'code-char (wire-body response)))
        (length (wire-header response "Content-Length")))
    (cond ((/= 200 (wire-status response))
           (format nil "status ~D, body ~S" (wire-status response) got))
          ((not (eq :content-length (wire-framing response)))
           (format nil "framed by ~A, not Content-Length" (wire-framing response)))
          ((/= (parse-integer length) (length (wire-body response)))
           (format nil "Content-Length ~A for ~D octets" length (length (wire-body response))))
          ((string/= got body)
           (format nil "body ~S, not ~S" got body)))))

(defun closed-or-reset-p (stream)
  "True if the server closes STREAM (end of file or a reset) within 10 s,
sending nothing more."
  (setf (sb-impl::fd-stream-timeout stream) 10.0)
  (handler-case (null (read-byte stream nil nil))
    (sb-sys:io-timeout () nil)
    (stream-error () t)))

(defun upload-client (port path framing)
  "One client as the header says.  NIL when everything was right, else a
description of what was not."
  (handler-case
      (let ((socket (connect port :timeout 60)))
        (unwind-protect
             (let ((stream (usocket:socket-stream socket)))
               (send socket (upload-head path framing))
               ;; The server may close early (/ignore): the answer is still read.
               (handler-case (send-upload-body stream framing)
                 (stream-error () nil))
               (or (check-exact-answer
                    (read-wire socket :persistent t)
                    (cond ((string= path "/upload") (princ-to-string *upload-body-bytes*))
                          ((string= path "/ignore") "ignored")
                          (t "streamed")))
                   (if (member path '("/upload" "/ignore") :test #'string=)
                       (progn (send socket (crlf "GET / HTTP/1.1" "Host: 127.0.0.1"))
                              (check-exact-answer (read-wire socket :persistent t) "ok"))
                       (unless (closed-or-reset-p stream)
                         "the connection stayed open after the answer"))))
          (ignore-errors (usocket:socket-close socket))))
    (error (e) (format nil "~A" e))))

;;; The test

(defparameter *upload-clients*
  '(("/upload" :length) ("/upload" :length) ("/upload" :length) ("/upload" :length)
    ("/upload" :chunked) ("/upload" :chunked) ("/upload" :chunked)
    ("/upload" :one-chunk) ("/upload" :one-chunk) ("/upload" :one-chunk)
    ("/ignore" :length) ("/ignore" :length) ("/ignore" :chunked) ("/ignore" :one-chunk))
  "(path framing) of the clients every server kind gets.")

(defparameter *streaming-upload-clients*
  '(("/stream" :length) ("/stream" :chunked) ("/stream" :one-chunk))
  "The clients whose bodies the server streams to their handler.")

(defun uploads-far-above-the-heap (kind clients)
  (let ((log (uiop:tmpize-pathname #p"/tmp/gallop-upload-child.log"))
        (stderr (uiop:tmpize-pathname #p"/tmp/gallop-upload-child.err")))
    (multiple-value-bind (process port heap) (start-upload-child kind log stderr)
      (unwind-protect
           (progn
             (is (integerp port) "the ~A child did not start: ~A" kind (file-text stderr))
             (when (integerp port)
               ;; The premise: the bodies sent to /upload alone are at
               ;; least twice the child's whole heap.
               (is (<= (* 2 heap) (* *upload-body-bytes*
                                      (count "/upload" clients :key #'first :test #'string=))))
               (let* ((results (loop for client in clients collect (list nil)))
                      (threads (loop for (path framing) in clients
                                     for result in results
                                     collect (let ((path path) (framing framing) (result result))
                                               (sb-thread:make-thread
                                                (lambda ()
                                                  (setf (car result)
                                                        (or (upload-client port path framing)
                                                            :ok)))
                                                :name "upload client")))))
                 (unless (wait-until (lambda () (notany #'sb-thread:thread-alive-p threads))
                                     :timeout 90 :interval 0.1)
                   ;; Killing the child ends every client's read and write.
                   (ignore-errors (sb-ext:process-kill process 9)))
                 (mapc (lambda (thread) (sb-thread:join-thread thread :default nil :timeout 30))
                       threads)
                 (loop for (path framing) in clients
                       for (result) in results
                       do (is (eq :ok result) "~A ~A ~(~A~): ~A" kind path framing
                              (or result "did not finish in 90 s"))))
               (is (sb-ext:process-alive-p process) "the ~A child died: ~A" kind (file-text stderr))
               (let ((problem (handler-case
                                  (let ((socket (connect port)))
                                    (unwind-protect
                                         (progn (send socket (crlf "GET / HTTP/1.1" "Host: 127.0.0.1"))
                                                (check-exact-answer
                                                 (read-wire socket :persistent t)
                                                 "ok"))
                                      (usocket:socket-close socket)))
                                (error (e) (format nil "~A" e)))))
                 (is (null problem) "GET / after the uploads: ~A" problem))))
        (end-upload-child process)
        (is (string= "" (file-text log)) "the ~A child logged:~%~A" kind (file-text log))
        (ignore-errors (delete-file log))
        (ignore-errors (delete-file stderr))))))

(test uploads-far-above-the-heap-native
  (uploads-far-above-the-heap "native" (append *upload-clients* *streaming-upload-clients*)))

(test uploads-far-above-the-heap-easy-acceptor
  (uploads-far-above-the-heap "easy-acceptor" (append *upload-clients* *streaming-upload-clients*)))

;;; The same path, in this process and on bytes: a handler that answers
;;; through HUNCHENTOOT:SEND-HEADERS without reading the body.  Hunchentoot's
;;; SEND-RESPONSE reads the unread body into memory before it writes the
;;; head, so the answer waited for the whole body (and held it).  Here the
;;; client sends 10 of the 1,000,000 octets it declares, and must get the
;;; answer, then see the connection closed, without sending the rest.  (The
;;; body is streamed to the handler, :STREAMED-BODIES: read first by the
;;; server, the answer would wait for it by design.)

(in-suite requests)

(hunchentoot:define-easy-handler (handle-stream-unread :uri "/stream-unread") ()
  (setf (hunchentoot:content-type*) "text/plain"
        (hunchentoot:content-length*) 8)
  (let ((out (hunchentoot:send-headers)))
    (write-sequence (octets "streamed") out)
    (finish-output out)
    nil))

(test send-headers-does-not-wait-for-the-unread-body
  ;; The server's read timeout (60 s) is far beyond the client's (10 s):
  ;; an answer that waited for the body would not come in time.
  (with-server (server 'gallop:easy-acceptor :read-timeout 60
                      :taskmaster (make-instance 'gallop:taskmaster
                                                 :streamed-bodies (constantly t)))
    (let ((socket (connect (port-of server) :timeout 10)))
      (unwind-protect
           (let ((stream (usocket:socket-stream socket)))
             (send socket (concatenate 'string
                                       (crlf "POST /stream-unread HTTP/1.1" "Host: 127.0.0.1"
                                             "Content-Type: application/octet-stream"
                                             "Content-Length: 1000000")
                                       "0123456789"))
             (let ((problem (handler-case (check-exact-answer (read-wire socket :persistent t)
                                                              "streamed")
                              (error (e) (format nil "~A" e)))))
               (is (null problem) "~A" problem))
             (is (closed-or-reset-p stream)))
        (usocket:socket-close socket)))))
