;;;; runner.lisp -- runs the conformance corpus (corpus.lisp) over raw
;;;; sockets (and TLS) against Gallop's four front ends, and (make conformance,
;;;; nginx.lisp) against nginx.
;;;;
;;;; For each case the client connects, writes the case's octets, half-closes
;;;; (shutdown SHUT_WR: the server sees end of file after the last byte, so no
;;;; case waits for a timeout), and reads every answer until the server
;;;; closes.  The answers are then read strictly, by the tests' one response
;;;; reader (PARSE-WIRE, tests/strict-reader.lisp), and compared with the verdict: the
;;;; sequence of statuses (interim 1xx answers aside), for each request served
;;;; the line the app wrote in its X-Seen header -- method, target, header
;;;; count, body length and MD5 of the body, exactly as the app saw them --
;;;; and, for an error Gallop writes itself, that it is a complete HTTP/1.1
;;;; message (Content-Type, Content-Length equal to the body, Connection:
;;;; close) followed by nothing.
;;;;
;;;; The four front ends, each started once for the whole corpus:
;;;;   :native          GALLOP:START with CONFORMANCE-APP
;;;;   :gallop-acceptor GALLOP:EASY-ACCEPTOR (subclass) with a default handler
;;;;   :stock-acceptor  HUNCHENTOOT:EASY-ACCEPTOR (subclass) with
;;;;                    :TASKMASTER (make-instance 'gallop:taskmaster)
;;;;   :ssl-acceptor    GALLOP:EASY-SSL-ACCEPTOR (subclass, the certificate
;;;;                    of hunchentoot/ssl.lisp) with the same handler
;;;; Their timeouts (*CONFORMANCE-SERVER-TIMEOUT*) are longer than the
;;;; client waits for them: no case may end by a server's timeout, since each
;;;; ends its input.  A server that waited for one instead of closing at the
;;;; client's end of input (its FIN, or over TLS its close_notify) fails the
;;;; case ("did not close within the time-out").
;;;;
;;;; Over TLS (hunchentoot/tls.lisp's client) each case gets a handshake of
;;;; its own; the octets are written a TLS record of at most 16 KiB at a
;;;; time, and the client's "half-close" is a close_notify alert (SSL_shutdown):
;;;; the server's TLS stream reads it as end of file, exactly where a plain
;;;; server sees the FIN, and the client keeps reading until the server's own
;;;; close_notify.  So every case, cut requests included, gets the plain
;;;; verdict over TLS: there is no case where TLS may differ.

(in-package #:gallop-tests)

(def-suite conformance :in gallop
  :description "The conformance corpus: one reading of every request, on every front end.")
(in-suite conformance)

;;; What the app saw, as one line: the app writes it, the runner expects it.

(defun md5-hex (octets)
  (format nil "~(~{~2,'0X~}~)"
          (coerce (sb-md5:md5sum-sequence (coerce octets '(simple-array (unsigned-byte 8) (*))))
                  'list)))

(defun seen-line (method target header-count body)
  "The X-Seen value for a request: METHOD TARGET HEADER-COUNT BODY-LENGTH
MD5-OF-BODY."
  (format nil "~A ~A ~D ~D ~A" method target header-count (length body) (md5-hex body)))

(defun read-stream-octets (stream)
  "Every octet left on the binary STREAM."
  (let ((out (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0))
        (buffer (make-array 4096 :element-type '(unsigned-byte 8))))
    (loop for n = (read-sequence buffer stream)
          do (loop for i below n do (vector-push-extend (aref buffer i) out))
          while (= n (length buffer)))
    out))

(defun conformance-app (env)
  "The native app: reads the whole :RAW-BODY and answers 200 with an empty
body and what it saw in X-Seen."
  (let ((body (let ((stream (getf env :raw-body)))
                (if stream (read-stream-octets stream) #()))))
    (list 200
          (list :content-type "text/plain"
                :x-seen (seen-line (symbol-name (getf env :request-method))
                                   (getf env :request-uri)
                                   (hash-table-count (getf env :headers))
                                   body))
          '(""))))

(defun conformance-handler ()
  "The Hunchentoot handler: the same as CONFORMANCE-APP."
  (let ((body (or (handler-bind ((chunga:chunga-warning #'muffle-warning))
                    ;; chunga warns of every chunk extension it keeps.
                    (hunchentoot:raw-post-data :force-binary t))
                  #())))
    (setf (hunchentoot:content-type*) "text/plain"
          (hunchentoot:header-out :x-seen)
          (seen-line (symbol-name (hunchentoot:request-method*))
                     (hunchentoot:request-uri*)
                     (length (hunchentoot:headers-in*))
                     body))
    ""))

(defclass conformance-gallop-acceptor (gallop:easy-acceptor) ()
  (:documentation "GALLOP:EASY-ACCEPTOR answering every request with CONFORMANCE-HANDLER."))

(defclass conformance-ssl-acceptor (gallop:easy-ssl-acceptor) ()
  (:documentation "GALLOP:EASY-SSL-ACCEPTOR answering every request with CONFORMANCE-HANDLER."))

(defclass conformance-stock-acceptor (hunchentoot:easy-acceptor) ()
  (:documentation "A stock HUNCHENTOOT:EASY-ACCEPTOR (run with GALLOP:TASKMASTER)
answering every request with CONFORMANCE-HANDLER."))

(defmethod hunchentoot:acceptor-dispatch-request ((acceptor conformance-gallop-acceptor) request)
  (declare (ignore request))
  (conformance-handler))

(defmethod hunchentoot:acceptor-dispatch-request ((acceptor conformance-ssl-acceptor) request)
  (declare (ignore request))
  (conformance-handler))

(defmethod hunchentoot:acceptor-dispatch-request ((acceptor conformance-stock-acceptor) request)
  (declare (ignore request))
  (conformance-handler))

(defparameter *conformance-front-ends* '(:native :gallop-acceptor :stock-acceptor :ssl-acceptor)
  "Gallop's front ends, each of which must give every case its verdict.")

(defun hunchentoot-front-end-p (front-end)
  (member front-end '(:gallop-acceptor :stock-acceptor :ssl-acceptor)))

(defparameter *conformance-server-timeout* 20
  "The front ends' timeouts, in seconds: over the client's 6 s wait (see the
top of this file).")

(defun call-with-conformance-front-end (front-end function)
  "Start FRONT-END on 127.0.0.1 and a free port, call FUNCTION with the port,
and always stop it."
  (ecase front-end
    (:native
     (let ((server (gallop:start #'conformance-app
                                 :address "127.0.0.1" :port 0
                                 :header-timeout *conformance-server-timeout*
                                 :idle-timeout *conformance-server-timeout*
                                 :read-timeout *conformance-server-timeout*
                                 :write-timeout *conformance-server-timeout*
                                 :log (if (uiop:getenv "GALLOP_TEST_LOG") *error-output* nil))))
       (unwind-protect (funcall function (gallop:server-port server))
         (gallop:stop server))))
    ((:gallop-acceptor :stock-acceptor :ssl-acceptor)
     (let ((acceptor (ecase front-end
                       (:gallop-acceptor
                        (make-server 'conformance-gallop-acceptor
                                     :read-timeout *conformance-server-timeout*
                                     :write-timeout *conformance-server-timeout*))
                       (:stock-acceptor
                        (make-server 'conformance-stock-acceptor
                                     :read-timeout *conformance-server-timeout*
                                     :write-timeout *conformance-server-timeout*
                                     :taskmaster (make-instance 'gallop:taskmaster)))
                       (:ssl-acceptor
                        (make-ssl-server 'conformance-ssl-acceptor
                                         :read-timeout *conformance-server-timeout*
                                         :write-timeout *conformance-server-timeout*)))))
       (hunchentoot:start acceptor)
       (unwind-protect (funcall function (port-of acceptor))
         (hunchentoot:stop acceptor))))))

;;; The client: write, half-close, read to end of file

(defun write-all (fd octets)
  "Write OCTETS to the blocking socket FD; NIL if the peer stopped reading
first (it may answer and close before all was sent: a refused head)."
  (sb-sys:with-pinned-objects (octets)
    (loop with start = 0
          while (< start (length octets))
          do (multiple-value-bind (n errno)
                 (sb-unix:unix-write fd octets start (- (length octets) start))
               (cond ((and n (plusp n)) (incf start n))
                     ((eql errno sb-unix:eintr))
                     (t (return-from write-all nil)))))
    t))

(defun exchange-octets (port octets &key (timeout 6))
  "Connect to 127.0.0.1:PORT, write OCTETS, half-close, and read until the
server closes.  Returns the octets read, and :TIMEOUT if nothing came for
TIMEOUT seconds before end of file, :RESET if the server reset the
connection, else NIL."
  (let ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp))
        (out (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0))
        (buffer (make-array 65536 :element-type '(unsigned-byte 8)))
        (writer nil))
    (unwind-protect
         (progn
           (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port)
           (let ((fd (sb-bsd-sockets:socket-file-descriptor socket)))
             (flet ((send-and-half-close ()
                      (write-all fd octets)
                      (ignore-errors (sb-bsd-sockets:socket-shutdown socket :direction :output))))
               ;; Large cases are written by a thread while this one reads,
               ;; so that neither side blocks on a full socket buffer.
               (if (< (length octets) 8192)
                   (send-and-half-close)
                   (setf writer (sb-thread:make-thread #'send-and-half-close
                                                       :name "conformance writer"))))
             (values out
                     (loop
                       (unless (sb-sys:wait-until-fd-usable fd :input timeout)
                         (return :timeout))
                       (multiple-value-bind (n errno)
                           (sb-sys:with-pinned-objects (buffer)
                             (sb-unix:unix-read fd (sb-sys:vector-sap buffer) (length buffer)))
                         (cond ((null n)
                                (unless (eql errno sb-unix:eintr)
                                  (return :reset)))
                               ((zerop n) (return nil))
                               (t (loop for i below n
                                        do (vector-push-extend (aref buffer i) out)))))))))
      (when writer (sb-thread:join-thread writer :default nil :timeout 10))
      (sb-bsd-sockets:socket-close socket))))

;;; Parsing what came back

(defun parse-answers (octets)
  "Split OCTETS, everything a server sent before it closed, into the
responses they hold, each read strictly by PARSE-WIRE (tests/strict-reader.lisp) as
it would be read off the connection: a WIRE-RESPONSE per answer, interim 1xx
answers included.  Second and third values: where the octets stop being a
valid response, the octets from there and the WIRE-ERROR saying why (a
Content-Length longer than what came, a malformed head, stray bytes ...);
NIL and NIL when every octet belongs to an answer."
  (let ((answers '()) (i 0))
    (loop while (< i (length octets))
          do (handler-case
                 (multiple-value-bind (answer end) (parse-wire octets :start i)
                   (push answer answers)
                   (setf i end))
               (wire-error (e)
                 (return-from parse-answers (values (nreverse answers) (subseq octets i) e)))))
    (values (nreverse answers) nil nil)))

;;; Running a case

(defstruct (outcome (:conc-name outcome-))
  answers   ; the WIRE-RESPONSEs read, in order
  leftover  ; the octets from the first that is not part of a valid answer
  error     ; the WIRE-ERROR saying why they are not
  end       ; how the connection ended: NIL (end of file), :TIMEOUT or :RESET
  octets)   ; everything the server sent

(defun run-case (case port &optional front-end)
  "Send CASE to the server on PORT (FRONT-END: over TLS for :SSL-ACCEPTOR);
its OUTCOME."
  (multiple-value-bind (octets end) (if (eq front-end :ssl-acceptor)
                                        (tls-exchange-octets port (case-octets case))
                                        (exchange-octets port (case-octets case)))
    (multiple-value-bind (answers leftover error) (parse-answers octets)
      (make-outcome :answers answers :leftover leftover :error error :end end :octets octets))))

(defun outcome-statuses (outcome)
  "The statuses of the final (non-1xx) answers of OUTCOME."
  (loop for a in (outcome-answers outcome)
        when (>= (wire-status a) 200) collect (wire-status a)))

(defun expected-seen-line (seen front-end)
  "The X-Seen line the app must write for the request SEEN, on every front
end: the method exactly as sent (methods are case-sensitive; Gallop hands
Hunchentoot the core's reading of it, not chunga's upper-cased one)."
  (declare (ignore front-end))
  (destructuring-bind (method target count body) seen
    (seen-line method target count body)))

(defun short (octets &optional (max 300))
  "OCTETS as a readable string, at most MAX characters."
  (let ((s (with-output-to-string (out)
             (loop for b across (subseq octets 0 (min (length octets) max))
                   do (cond ((= b 13) (write-string "\\r" out))
                            ((= b 10) (write-string "\\n" out))
                            ((or (< b 32) (>= b 127)) (format out "\\x~2,'0X" b))
                            (t (write-char (code-char b) out)))))))
    (if (> (length octets) max) (concatenate 'string s "...") s)))

(defun front-end-verdict (case front-end)
  "CASE as FRONT-END must answer it.  A Hunchentoot front end over a
Hunchentoot that reads only some methods (1.3.x: GALLOP::HUNCHENTOOT-REQUEST-
METHODS) answers the first request with another method (exact case) 501
and closes, after serving those before it; elsewhere CASE stands."
  (let* ((methods (and (hunchentoot-front-end-p front-end) (gallop::hunchentoot-request-methods)))
         (refused (and methods
                       (position-if-not (lambda (seen)
                                          (member (first seen) methods
                                                  :key #'symbol-name :test #'string=))
                                        (case-seen case)))))
    (if refused
        (let ((copy (copy-conformance-case case)))
          (setf (case-seen copy) (subseq (case-seen case) 0 refused)
                (case-then copy) 501)
          copy)
        case)))

(defun verdict-problems (case outcome front-end)
  "What is wrong with OUTCOME as the answer of FRONT-END to CASE: a list of
strings, NIL when it is the case's verdict (FRONT-END-VERDICT)."
  (let ((case (front-end-verdict case front-end))
        (problems '())
        (final (remove-if (lambda (a) (< (wire-status a) 200)) (outcome-answers outcome))))
    (flet ((problem (control &rest args) (push (apply #'format nil control args) problems)))
      (when (eq (outcome-end outcome) :timeout)
        (problem "the server did not close within the time-out"))
      (when (and (eq front-end :ssl-acceptor) (eq (outcome-end outcome) :reset))
        ;; RFC 9112 9.8: a server closes a TLS connection with close_notify.
        (problem "the TLS connection ended without the server's close_notify"))
      (unless (equal (outcome-statuses outcome) (expected-statuses case))
        (problem "statuses ~S, expected ~S" (outcome-statuses outcome) (expected-statuses case)))
      ;; An answer cut short of its Content-Length, a malformed one, or
      ;; bytes after the last: PARSE-ANSWERS stopped there and says why.
      (when (outcome-leftover outcome)
        (problem "bytes that are not a response (~A): ~S"
                 (wire-error-message (outcome-error outcome)) (short (outcome-leftover outcome))))
      (loop for seen in (case-seen case)
            for answer in final
            for expected = (expected-seen-line seen front-end)
            for got = (wire-header answer "X-Seen")
            when (and (= 200 (wire-status answer)) (not (equal got expected)))
              do (problem "the app saw ~S, expected ~S" got expected))
      ;; An answer Gallop writes itself is a complete message that closes.
      ;; (A repeated field reads as a list of values: not a single "close".)
      (let ((error-answer (nth (length (case-seen case)) final)))
        (when (and error-answer (integerp (case-then case))
                   (= (wire-status error-answer) (case-then case)))
          (unless (wire-header error-answer "Content-Length")
            (problem "the ~D answer has no Content-Length" (wire-status error-answer)))
          (unless (wire-header error-answer "Content-Type")
            (problem "the ~D answer has no Content-Type" (wire-status error-answer)))
          (unless (equalp "close" (wire-header error-answer "Connection"))
            (problem "the ~D answer does not say Connection: close"
                     (wire-status error-answer))))))
    (nreverse problems)))

(defun run-corpus (front-end &key (cases (corpus-cases)))
  "Run CASES against a fresh FRONT-END; a list of (CASE OUTCOME PROBLEMS)."
  (call-with-conformance-front-end front-end
                       (lambda (port)
                         (loop for case in cases
                               for outcome = (run-case case port front-end)
                               collect (list case outcome
                                             (verdict-problems case outcome front-end))))))

(defun describe-failure (case outcome problems front-end)
  (format nil "~A (RFC ~A) on ~(~A~): ~{~A~^; ~}~%  sent:     ~A~%  received: ~A"
          (case-name case) (case-section case) front-end problems
          (short (case-octets case)) (short (outcome-octets outcome))))

(defun check-front-end (front-end)
  "One FiveAM check per case: FRONT-END gives it its verdict."
  (loop for (case outcome problems) in (run-corpus front-end)
        do (is (null problems) "~A" (describe-failure case outcome problems front-end))))

(defun find-case (name)
  (or (find name (corpus-cases) :key #'case-name :test #'string=)
      (error "No conformance case named ~S." name)))

(defun try-case (name &optional (front-end :native))
  "Run the case NAME against a fresh FRONT-END and describe what came back
(for debugging at the REPL)."
  (let ((case (find-case name)))
    (destructuring-bind (case outcome problems) (first (run-corpus front-end :cases (list case)))
      (format t "~&~A~%" (if problems
                             (describe-failure case outcome problems front-end)
                             (format nil "~A: ok~%  received: ~A" name
                                     (short (outcome-octets outcome) 2000)))))
    (values)))

;;; The tests

(test conformance-corpus-is-well-formed
  (let* ((cases (corpus-cases))
         (problems
           (loop for case in cases
                 for name = (case-name case)
                 unless (plusp (length (case-section case)))
                   collect (format nil "~A: no RFC section" name)
                 unless (or (null (case-then case)) (eq :close (case-then case))
                            (member (case-then case) '(400 413 414 431 501 505)))
                   collect (format nil "~A: verdict ~S" name (case-then case))
                 unless (or (case-seen case) (case-then case))
                   collect (format nil "~A: neither requests seen nor an end" name)
                 append (loop for seen in (case-seen case)
                              unless (and (plusp (length (first seen))) (plusp (length (second seen)))
                                          (typep (third seen) '(integer 0)))
                                collect (format nil "~A: malformed expected request ~S" name seen)))))
    (is (>= (length cases) 150) "only ~D cases" (length cases))
    (is (= (length cases)
           (length (remove-duplicates cases :key #'case-name :test #'string=)))
        "case names are not unique")
    (is (null problems) "~{~A~^~%~}" problems)))

(test conformance-parser-reads-answers-exactly
  ;; The runner's splitting of what came back, on byte vectors: three
  ;; answers and a rest.
  (multiple-value-bind (answers leftover error)
      (parse-answers (unescape (concatenate 'string
                                            "HTTP/1.1 100 Continue||"
                                            "HTTP/1.1 200 OK|X-Seen: a|Content-Length: 2||hi"
                                            "HTTP/1.1 400 Bad Request|Content-Length: 3|Connection: close||bad"
                                            "junk")))
    (is (equal '(100 200 400) (mapcar #'wire-status answers)))
    (is (equalp (unescape "hi") (wire-body (second answers))))
    (is (equal "a" (wire-header (second answers) "x-seen")))
    (is (equalp (unescape "junk") leftover))
    (is (and error (search "ended inside the status line" (wire-error-message error)))))
  (multiple-value-bind (answers leftover error)
      (parse-answers (unescape "HTTP/1.1 200 OK|Content-Length: 0||HTTP/1.1 204 No Content||"))
    (is (equal '(200 204) (mapcar #'wire-status answers)))
    (is (null leftover))
    (is (null error)))
  ;; An answer that ends before its Content-Length is not an answer, and
  ;; the verdict check says so.
  (let* ((case (find-case "cl-plus-sign"))
         (octets (unescape "HTTP/1.1 400 Bad Request|Content-Type: text/plain|Content-Length: 11|Connection: close||short")))
    (multiple-value-bind (answers leftover error) (parse-answers octets)
      (is (null answers))
      (is (equalp octets leftover))
      (is (and error (search "after 5 of 11 body bytes" (wire-error-message error))))
      (let ((problems (verdict-problems case (make-outcome :answers answers :leftover leftover
                                                           :error error :octets octets)
                                        :native)))
        (is (equal "statuses NIL, expected (400)" (first problems)))
        (is (search "after 5 of 11 body bytes" (second problems)) "~S" problems))))
  ;; and the verdict check finds an error answer that does not close
  (let* ((case (find-case "cl-plus-sign"))
         (octets (unescape "HTTP/1.1 400 Bad Request|Content-Length: 3||bad")))
    (multiple-value-bind (answers leftover error) (parse-answers octets)
      (is (equal '("the 400 answer has no Content-Type"
                   "the 400 answer does not say Connection: close")
                 (verdict-problems case (make-outcome :answers answers :leftover leftover
                                                      :error error :octets octets)
                                   :native))))))

(test conformance-native
  (check-front-end :native))

(test conformance-gallop-acceptor
  (check-front-end :gallop-acceptor))

(test conformance-stock-acceptor-with-gallop-taskmaster
  (check-front-end :stock-acceptor))

(test conformance-ssl-acceptor-over-tls
  (check-front-end :ssl-acceptor))
